"""The reader's own project that the docs' Python samples take for granted.

A sample writes ``serializer_class = PaymentSerializer`` or ``from payments.models import Payment``:
those names are the reader's, not the library's. ``PROJECT`` gives them to every sample, and
``install()`` puts the reader's packages (``payments``, ``orders``, ``billing``, ``myproject``) in
``sys.modules``, backed by the test app's models. Library, Django and standard names are never
given: a sample that uses one must import it, as the reader's code would.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

from django.db import models
from django.urls import path
from rest_framework import generics, serializers
from rest_framework.authentication import BasicAuthentication, SessionAuthentication

from django_idempotency.drf import IdempotentMixin
from tests.testapp.models import Document, LedgerEntry, Payment, Refund


class PaymentSerializer(serializers.ModelSerializer):
    class Meta:
        model = Payment
        fields = ["id", "amount", "currency"]

    def create(self, validated_data: dict[str, Any]) -> Payment:
        request = self.context["request"]
        owner = request.user if request.user.is_authenticated else None
        return Payment.objects.create(owner=owner, **validated_data)


@dataclass
class Charge:
    id: str
    amount: int


class Provider:
    """A payment provider that deduplicates on the idempotency key it is given."""

    class Timeout(Exception):
        pass

    def __init__(self) -> None:
        self.charges: dict[str, Charge] = {}

    def charge(self, amount: int, idempotency_key: str, timeout: float = 10) -> Charge:
        return self.charges.setdefault(
            idempotency_key, Charge(f"ch_{len(self.charges) + 1}", int(amount))
        )

    def find_charge(self, idempotency_key: str) -> Charge | None:
        return self.charges.get(idempotency_key)


@dataclass
class Recorder:
    """A downstream service (a ledger, an event bus) that keeps what it was sent."""

    sent: list[tuple[Any, ...]] = field(default_factory=list)

    def post_event(self, *args: Any, **kwargs: Any) -> None:
        self.sent.append((*args, kwargs))

    send = post_event


@dataclass
class Order:
    pk: int = 7
    status: str = "new"
    amount_cents: int = 1250

    def mark_paid(self) -> None:
        self.status = "paid"

    def save(self, **kwargs: Any) -> None:
        pass


@dataclass
class Balance:
    amount: int
    stale_for: float = 0.0


def cached_balance(stale_for: float) -> Balance:
    return Balance(0, stale_for)


def ask_the_provider(key: Any) -> Any:
    """A reconcile hook: nothing is known downstream, so the key is left for a person."""
    return None


provider = Provider()

# Names a sample may use without importing them: the reader's models, serializer and services.
PROJECT: dict[str, Any] = {
    "Payment": Payment,
    "PaymentSerializer": PaymentSerializer,
    "LedgerEntry": LedgerEntry,
    "Refund": Refund,
    "Note": Document,
    "order": Order(),
    "provider": provider,
    "ledger": Recorder(),
    "event_bus": Recorder(),
    "Balance": Balance,
    "cached_balance": cached_balance,
}


def module(name: str, **attributes: Any) -> types.ModuleType:
    """A module of the reader's project, put in ``sys.modules`` (with its parent packages)."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            parent = types.ModuleType(package)
            parent.__path__ = []
            sys.modules[package] = parent
    made = sys.modules.get(name) or types.ModuleType(name)
    made.__dict__.update(attributes)
    sys.modules[name] = made
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], made)
    return made


class PaymentView(IdempotentMixin, generics.ListCreateAPIView):
    """The reader's payments API, served at ``/api/payments/`` to the docs' test samples."""

    serializer_class = PaymentSerializer
    queryset = Payment.objects.all()
    # DRF's default authentication: the samples log in with the test client's session.
    authentication_classes = [SessionAuthentication, BasicAuthentication]


urlpatterns = [path("api/payments/", PaymentView.as_view())]


def install(*, api: bool = False) -> None:
    """The reader's packages, as the samples import them; with ``api``, their payments API too."""
    if api:
        module("payments.views", PaymentView=PaymentView)
        module("payments.urls", urlpatterns=urlpatterns)
    module("payments.models", Payment=Payment, LedgerEntry=LedgerEntry, models=models)
    module("payments.serializers", PaymentSerializer=PaymentSerializer)
    module("payments.reconcile", ask_the_provider=ask_the_provider)
    module("billing.models", Invoice=Refund)
