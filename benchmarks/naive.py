"""A deliberately naive idempotent payment view: the floor the library is measured against.

Atomic mode at its simplest, in the view's transaction: claim the key on a unique index (one
``INSERT … ON CONFLICT DO NOTHING RETURNING`` on PostgreSQL, ``INSERT IGNORE`` on MariaDB), run
the view, store its status and body with one ``UPDATE``; a key already taken is answered by one
``SELECT``. No policy, expiry, signals, metrics, logging, cache or headers kept: what is left is
the two statements every correct atomic-mode layer needs, around the same view as ``bare``. The
benchmark creates its table (``databases.py``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from django.db import connection, transaction
from django.http import HttpResponse, JsonResponse
from rest_framework import generics

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
                return HttpResponse(bytes(body), status=status, content_type="application/json")
            # An exception rolls the claim back with the view's writes: nothing is kept.
            response = self.finalize_response(request, super().post(request, *args, **kwargs))
            response.render()
            cursor.execute(COMPLETE, [response.status_code, response.content, row])
        return response
