"""The example's URLs, plus the payment views without IdempotentMixin or @idempotent, and the
naive floors."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.cache import caches
from django.db import transaction
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from rest_framework import generics

from benchmarks.naive import bare_webhook, naive_idempotent, naive_webhook
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


class NaivePaymentList(generics.ListCreateAPIView):  # type: ignore[type-arg] # any model
    """The example's payment view made idempotent by hand (naive.py): the floor under
    PaymentList. Its writes join the naive layer's transaction."""

    serializer_class = PaymentList.serializer_class
    get_queryset = PaymentList.get_queryset
    perform_create = PaymentList.perform_create  # type: ignore[assignment] # the same view
    cache: str | None = None

    def post(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        def respond() -> Any:
            answer = super(NaivePaymentList, self).post(request, *args, **kwargs)
            response = self.finalize_response(request, answer)
            response.render()
            return response

        cache = None if self.cache is None else caches[self.cache]
        return naive_idempotent(request._request, request.user.pk, respond, cache)


class NaiveCachedPaymentList(NaivePaymentList):
    """The naive view behind the same Redis as the replay cache's: a key's first replay stores
    its answer there, and later ones are one ``GET`` after authentication and permissions."""

    cache = "bench-replay"


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
def provider_naive_webhook(request: HttpRequest) -> JsonResponse:
    """The naive inbox (naive.py) with the provider's secret."""
    return naive_webhook(request, settings.PROVIDER_WEBHOOK_SECRETS[0])


urlpatterns = [
    *example_urlpatterns,
    path("bench/bare/payments/", BarePaymentList.as_view()),
    path("bench/bare/async/payments/", bare_async_payment),
    path("bench/bare/webhooks/", bare_webhook),
    path("bench/naive/payments/", NaivePaymentList.as_view()),
    path("bench/naive/cached/payments/", NaiveCachedPaymentList.as_view()),
    path("bench/naive/webhooks/", provider_naive_webhook),
    path("bench/cached/payments/", CachedPaymentList.as_view()),
]
