"""The example's URLs, plus the payment view without IdempotentMixin, and the naive floors."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics

from benchmarks.naive import NaiveCachedPaymentList, NaivePaymentList, naive_webhook
from example_project.urls import urlpatterns as example_urlpatterns
from payments import provider
from payments.views import PaymentList

if TYPE_CHECKING:
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
    path("bench/bare/webhooks/", bare_webhook),
    path("bench/naive/payments/", NaivePaymentList.as_view()),
    path("bench/naive/cached/payments/", NaiveCachedPaymentList.as_view()),
    path("bench/naive/webhooks/", naive_webhook),
    path("bench/cached/payments/", CachedPaymentList.as_view()),
]
