"""Deliberately naive idempotency: the floors the library is measured against.

``NaivePaymentList`` is atomic mode at its simplest, in the view's transaction: claim the key on a
unique index (one ``INSERT … ON CONFLICT DO NOTHING RETURNING`` on PostgreSQL, ``INSERT IGNORE``
on MariaDB), run the view, store its status and body with one ``UPDATE``; a key already taken is
answered by one ``SELECT``. No policy, expiry, signals, metrics, logging or headers kept: what is
left is the two statements every correct atomic-mode layer needs, around the same view as
``bare``. ``NaiveCachedPaymentList`` puts the replay cache's Redis in front of it: a replay is
one ``GET`` after authentication. ``naive_webhook`` is an inbox at its simplest: check Stripe's
signature, insert the event on a unique index of its id, nothing else. The benchmark creates
their tables (``databases.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.cache import caches
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics

from benchmarks.databases import NAIVE_EVENT_TABLE
from benchmarks.databases import NAIVE_TABLE as TABLE
from payments.views import PaymentList

if TYPE_CHECKING:
    from rest_framework.request import Request

CLAIM = {
    "postgresql": f"INSERT INTO {TABLE} (idempotency_key, fingerprint) VALUES (%s, %s) "
    "ON CONFLICT DO NOTHING RETURNING id",
    "mysql": f"INSERT IGNORE INTO {TABLE} (idempotency_key, fingerprint) VALUES (%s, %s)",
}
REPLAY = f"SELECT status, body, fingerprint FROM {TABLE} WHERE idempotency_key = %s"
COMPLETE = f"UPDATE {TABLE} SET status = %s, body = %s WHERE id = %s"


def claim(cursor: Any, key: str, fingerprint: str) -> int | None:
    """The new row's id, or ``None`` if the key is taken (after its holder committed)."""
    cursor.execute(CLAIM[connection.vendor], [key, fingerprint])
    if connection.vendor == "postgresql":
        row = cursor.fetchone()
        return None if row is None else int(row[0])
    return int(cursor.lastrowid) if cursor.rowcount == 1 else None


class NaivePaymentList(generics.ListCreateAPIView):  # type: ignore[type-arg] # any model
    """The example's payment view, made idempotent by hand as above."""

    serializer_class = PaymentList.serializer_class
    get_queryset = PaymentList.get_queryset
    perform_create = PaymentList.perform_create  # type: ignore[assignment] # the same view

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        header = request.headers.get("Idempotency-Key")
        if header is None:
            return super().post(request, *args, **kwargs)
        key = f"{request.user.pk}:{header}"
        fingerprint = hashlib.sha256(request._request.body).hexdigest()
        with transaction.atomic(), connection.cursor() as cursor:
            row = claim(cursor, key, fingerprint)
            if row is None:
                cursor.execute(REPLAY, [key])
                status, body, stored_fingerprint = cursor.fetchone()
                if stored_fingerprint != fingerprint:
                    return JsonResponse({"detail": "key reused"}, status=422)
                return self.replay(key, status, bytes(body), fingerprint)
            # An exception rolls the claim back with the view's writes: nothing is kept.
            response = self.finalize_response(request, super().post(request, *args, **kwargs))
            response.render()
            cursor.execute(COMPLETE, [response.status_code, response.content, row])
        return response

    def replay(self, key: str, status: int, body: bytes, fingerprint: str) -> HttpResponse:
        return HttpResponse(body, status=status, content_type="application/json")


class NaiveCachedPaymentList(NaivePaymentList):
    """The naive view behind the same Redis as the replay cache's: a key's first replay stores
    its answer there, and later ones are one ``GET`` after authentication and permissions."""

    def post(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        header = request.headers.get("Idempotency-Key")
        if header is not None:
            stored = caches["bench-replay"].get(f"naive:{request.user.pk}:{header}")
            if stored is not None:
                status, body, fingerprint = stored
                if fingerprint == hashlib.sha256(request._request.body).hexdigest():
                    return HttpResponse(body, status=status, content_type="application/json")
        return super().post(request, *args, **kwargs)

    def replay(self, key: str, status: int, body: bytes, fingerprint: str) -> HttpResponse:
        caches["bench-replay"].set(f"naive:{key}", (status, body, fingerprint), timeout=3600)
        return super().replay(key, status, body, fingerprint)


RECORD = {
    "postgresql": f"INSERT INTO {NAIVE_EVENT_TABLE} (event_id, payload) VALUES (%s, %s) "
    "ON CONFLICT DO NOTHING",
    "mysql": f"INSERT IGNORE INTO {NAIVE_EVENT_TABLE} (event_id, payload) VALUES (%s, %s)",
}


@csrf_exempt
def naive_webhook(request: HttpRequest) -> JsonResponse:
    """Check the ``Stripe-Signature`` header (``t=<unix>,v1=<hex>``: HMAC-SHA256 of
    ``"<t>.<body>"``, five minutes' tolerance), then record the event once by its id."""
    fields = dict(
        item.partition("=")[::2] for item in request.headers.get("Stripe-Signature", "").split(",")
    )
    timestamp, signature = fields.get("t", ""), fields.get("v1", "")
    secret = settings.PROVIDER_WEBHOOK_SECRETS[0].encode()
    expected = hmac.new(secret, f"{timestamp}.".encode() + request.body, hashlib.sha256).hexdigest()
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
