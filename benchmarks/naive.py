"""Deliberately naive idempotency: the floors the library is measured against.

``naive_idempotent`` is atomic mode at its simplest, in the view's transaction: claim the key on a
unique index under a bounded lock wait (one ``INSERT … ON CONFLICT DO NOTHING RETURNING`` that
sets ``lock_timeout`` on PostgreSQL, ``SET STATEMENT innodb_lock_wait_timeout … FOR INSERT
IGNORE`` on MariaDB), run the view, store its status and body with one ``UPDATE``; a key already
taken is answered by one ``SELECT``. No policy, expiry, signals, metrics, logging or headers kept,
and the lock bound is left on the view's own statements: what is left is the two statements every
correct atomic-mode layer needs. ``cached`` puts a Redis in front of it: a replay is one ``GET``.
``naive_webhook`` is an inbox at its simplest: check Stripe's signature, insert the event on a
unique index of its id, nothing else. The benchmark creates their tables (``databases.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from benchmarks.databases import NAIVE_EVENT_TABLE
from benchmarks.databases import NAIVE_TABLE as TABLE

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.core.cache import BaseCache

WAIT_MS = 5000  # how long a duplicate waits for the key's first request, as the library's default
CLAIM = {
    "postgresql": f"INSERT INTO {TABLE} (idempotency_key, fingerprint) "
    f"SELECT %s, %s FROM (SELECT set_config('lock_timeout', '{WAIT_MS}ms', true)) AS bounded "
    "ON CONFLICT DO NOTHING RETURNING id",
    "mysql": f"SET STATEMENT innodb_lock_wait_timeout = {WAIT_MS // 1000} FOR "
    f"INSERT IGNORE INTO {TABLE} (idempotency_key, fingerprint) VALUES (%s, %s)",
}
REPLAY = f"SELECT status, body, fingerprint FROM {TABLE} WHERE idempotency_key = %s"
COMPLETE = f"UPDATE {TABLE} SET status = %s, body = %s WHERE id = %s"


def naive_idempotent(
    request: HttpRequest,
    user_id: Any,
    respond: Callable[[], HttpResponse],
    cache: BaseCache | None = None,
) -> HttpResponse:
    """``respond()``'s response, once per key of the user; a key already used replays it."""
    header = request.headers.get("Idempotency-Key")
    if header is None:
        return respond()
    key = f"{user_id}:{header}"
    fingerprint = hashlib.sha256(request.body).hexdigest()
    if cache is not None and (stored := cache.get(f"naive:{key}")) is not None:
        status, body, stored_fingerprint = stored
        if stored_fingerprint == fingerprint:
            return HttpResponse(body, status=status, content_type="application/json")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(CLAIM[connection.vendor], [key, fingerprint])
        if connection.vendor == "postgresql":
            claimed = cursor.fetchone()
            row = None if claimed is None else claimed[0]
        else:
            row = cursor.lastrowid if cursor.rowcount == 1 else None
        if row is None:
            cursor.execute(REPLAY, [key])
            status, body, stored_fingerprint = cursor.fetchone()
            if stored_fingerprint != fingerprint:
                return JsonResponse({"detail": "key reused"}, status=422)
            if cache is not None:
                cache.set(f"naive:{key}", (status, bytes(body), fingerprint), timeout=3600)
            return HttpResponse(bytes(body), status=status, content_type="application/json")
        # An exception rolls the claim back with the view's writes: nothing is kept.
        response = respond()
        cursor.execute(COMPLETE, [response.status_code, response.content, row])
    return response


RECORD = {
    "postgresql": f"INSERT INTO {NAIVE_EVENT_TABLE} (event_id, payload) VALUES (%s, %s) "
    "ON CONFLICT DO NOTHING",
    "mysql": f"INSERT IGNORE INTO {NAIVE_EVENT_TABLE} (event_id, payload) VALUES (%s, %s)",
}


def naive_webhook(request: HttpRequest, secret: str) -> JsonResponse:
    """Check the ``Stripe-Signature`` header (``t=<unix>,v1=<hex>``: HMAC-SHA256 of
    ``"<t>.<body>"``, five minutes' tolerance), then record the event once by its id."""
    fields = dict(
        item.partition("=")[::2] for item in request.headers.get("Stripe-Signature", "").split(",")
    )
    timestamp, signature = fields.get("t", ""), fields.get("v1", "")
    expected = hmac.new(
        secret.encode(), f"{timestamp}.".encode() + request.body, hashlib.sha256
    ).hexdigest()
    if not (
        timestamp.isdigit()
        and hmac.compare_digest(expected, signature)
        and abs(time.time() - int(timestamp)) <= 300
    ):
        return JsonResponse({"detail": "bad signature"}, status=400)
    payload = json.loads(request.body)
    with connection.cursor() as cursor:
        cursor.execute(RECORD[connection.vendor], [payload["id"], request.body.decode()])
    return JsonResponse({"status": "recorded"})


@csrf_exempt
def bare_webhook(request: HttpRequest) -> JsonResponse:
    """What the inbox is measured against: parse the body and insert it, nothing more."""
    payload = json.loads(request.body)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO bench_bare_event (event_id, payload) VALUES (%s, %s)",
            [payload["id"], request.body.decode()],
        )
    return JsonResponse({"status": "inserted"})
