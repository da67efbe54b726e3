"""The minimal project's views: a payment viewset, bare, idempotent and naive, and webhooks."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.cache import caches
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers, viewsets

from benchmarks.minimal.models import Payment
from benchmarks.naive import naive_idempotent, naive_webhook
from django_idempotency.drf import IdempotentMixin
from django_idempotency.inbox import WebhookReceiverView, inbox_handler
from django_idempotency.signing import StripeSignature

if TYPE_CHECKING:
    from django.http import HttpRequest, JsonResponse
    from rest_framework.request import Request
    from rest_framework.response import Response

    from django_idempotency.policy import Policy


class PaymentSerializer(serializers.ModelSerializer):  # type: ignore[type-arg]
    class Meta:
        model = Payment
        fields = ["id", "amount", "currency", "description"]


class BarePayments(viewsets.ModelViewSet):  # type: ignore[type-arg]
    """What the user wrote: create is one insert."""

    queryset = Payment.objects.all()
    serializer_class = PaymentSerializer


class Payments(IdempotentMixin, BarePayments):
    """The same, made idempotent as the quick start says."""


class CachedPayments(Payments):
    """The same, its replays served by the replay cache, as the ``CACHE`` setting would."""

    def get_idempotency_policy(self) -> Policy:
        return replace(super().get_idempotency_policy(), cache="replay")


class NaivePayments(BarePayments):
    """The bare viewset, made idempotent by hand: the floor (``benchmarks/naive.py``)."""

    cache: str | None = None

    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        def respond() -> Response:
            response = self.finalize_response(request, super(NaivePayments, self).create(request))
            response.render()
            return response

        cache = None if self.cache is None else caches[self.cache]
        return naive_idempotent(request._request, request.user.pk, respond, cache)  # type: ignore[return-value]


class NaiveCachedPayments(NaivePayments):
    cache = "replay"


@csrf_exempt
def naive_inbox(request: HttpRequest) -> JsonResponse:
    return naive_webhook(request, settings.WEBHOOK_SECRET)


class ProviderWebhook(WebhookReceiverView):
    source = "provider"
    verifier = StripeSignature([settings.WEBHOOK_SECRET])


@inbox_handler("provider", "refund.succeeded")
def refund_succeeded(event: Any) -> None:
    """Never runs while the ingest is measured: no worker runs."""
