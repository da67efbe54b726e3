"""The example's URLs, plus the payment views without IdempotentMixin or @idempotent, and the
naive floors."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.db import connection, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics

from benchmarks.naive import NaiveCachedPaymentList, NaivePaymentList, naive_webhook
from example_project.urls import urlpatterns as example_urlpatterns
from payments import provider
from payments.async_views import authenticated, created, payment_input
from payments.models import LedgerEntry, Payment
from payments.views import PaymentList

if TYPE_CHECKING:
    from typing import Any

    from django_idempotency.policy import Policy

# Measure the library, not the fake provider's simulated latency.
provider.LATENCY = 0.0


class BarePaymentList(generics.ListCreateAPIView):
    """PaymentList without the mixin; its writes in one transaction, as a careful view has."""

    serializer_class = PaymentList.serializer_class
    get_queryset = PaymentList.get_queryset

    def perform_create(self, serializer):
        with transaction.atomic():
            PaymentList.perform_create(self, serializer)


class CachedPaymentList(PaymentList):
    """The example's idempotent payment view, its replays served by the replay cache (Redis)."""

    def get_idempotency_policy(self) -> Policy:
        return replace(super().get_idempotency_policy(), cache="bench-replay")


@csrf_exempt
@authenticated
async def bare_async_payment(request: HttpRequest) -> HttpResponse:
    """The example's async payment view without @idempotent (benchmarks/asgi_requests.py); its
    writes in one transaction, as a careful async view has them."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    data = payment_input(request)
    if isinstance(data, HttpResponse):
        return data
    reference = await provider.aauthorize(data["amount"], data["currency"])
    payment = await sync_to_async(_record_atomically)(request.user, data, reference)
    return created(request, payment)


def _record_atomically(owner: Any, data: dict[str, Any], reference: str) -> Payment:
    with transaction.atomic():
        payment = Payment.objects.create(owner=owner, provider_reference=reference, **data)
        LedgerEntry.objects.create(
            payment=payment,
            kind=LedgerEntry.Kind.CHARGE,
            amount=payment.amount,
            currency=payment.currency,
        )
    return payment


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


urlpatterns = [
    *example_urlpatterns,
    path("bench/bare/payments/", BarePaymentList.as_view()),
    path("bench/bare/async/payments/", bare_async_payment),
    path("bench/bare/webhooks/", bare_webhook),
    path("bench/naive/payments/", NaivePaymentList.as_view()),
    path("bench/naive/cached/payments/", NaiveCachedPaymentList.as_view()),
    path("bench/naive/webhooks/", naive_webhook),
    path("bench/cached/payments/", CachedPaymentList.as_view()),
]
