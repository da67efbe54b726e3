"""The example's URLs, plus the payment view without IdempotentMixin for comparison."""

from __future__ import annotations

from django.db import transaction
from django.urls import path
from rest_framework import generics

from example_project.urls import urlpatterns as example_urlpatterns
from payments import provider
from payments.views import PaymentList

# Measure the library, not the fake provider's simulated latency.
provider.LATENCY = 0.0


class BarePaymentList(generics.ListCreateAPIView):
    """PaymentList without the mixin; its writes in one transaction, as a careful view has."""

    serializer_class = PaymentList.serializer_class
    get_queryset = PaymentList.get_queryset

    def perform_create(self, serializer):
        with transaction.atomic():
            PaymentList.perform_create(self, serializer)


urlpatterns = [
    *example_urlpatterns,
    path("bench/bare/payments/", BarePaymentList.as_view()),
]
