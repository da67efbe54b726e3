"""The reader's own project that the docs' Python samples take for granted.

A sample writes ``serializer_class = PaymentSerializer`` or ``from payments.models import Payment``:
those names are the reader's, not the library's. ``PROJECT`` gives them to every sample, and
``install()`` puts the reader's packages (``payments``, ``orders``, ``billing``, ``myproject``) in
``sys.modules``, backed by the test app's models. Library, Django and standard names are never
given: a sample that uses one must import it, as the reader's code would.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from typing import Any, ClassVar

from django.db import models
from django.urls import path
from rest_framework import generics, serializers
from rest_framework.authentication import BasicAuthentication, SessionAuthentication

from django_idempotency.drf import IdempotentMixin
from django_idempotency.signing import StandardWebhooksSignature
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

    def as_json(self) -> str:
        return json.dumps({"id": self.id, "amount": self.amount})


class Provider:
    """A payment provider that deduplicates on the idempotency key it is given."""

    class Timeout(Exception):
        pass

    class Unavailable(Exception):
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

    send = record_payment = post_event


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


@dataclass
class Message:
    id: str


class MailProvider:
    """A mail service that sends a message once per idempotency key."""

    def __init__(self) -> None:
        self.sent: dict[str, Message] = {}

    def send(self, *args: Any, idempotency_key: str) -> Message:
        return self.sent.setdefault(idempotency_key, Message(f"msg_{len(self.sent) + 1}"))

    def find(self, idempotency_key: str) -> Message | None:
        return self.sent.get(idempotency_key)


@dataclass
class ReceiptEmail:
    """The reader's receipt model, its rows kept in memory."""

    payment_id: int
    pk: int = 0
    objects: ClassVar[Receipts]


class Receipts:
    """``ReceiptEmail.objects``."""

    def __init__(self) -> None:
        self.rows: list[ReceiptEmail] = []

    def create(self, **fields: Any) -> ReceiptEmail:
        row = ReceiptEmail(pk=len(self.rows) + 1, **fields)
        self.rows.append(row)
        return row


ReceiptEmail.objects = Receipts()


# The example secret of the Standard Webhooks specification, as the inbox page's sender uses.
WEBHOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def webhook_secrets() -> list[str]:
    """The reader's secrets for a sender, read at every delivery."""
    return [WEBHOOK_SECRET]


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
    "Order": Order,
    "mail_provider": MailProvider(),
    "alert": Recorder().send,  # the reader's paging function
    "orders_verifier": StandardWebhooksSignature(webhook_secrets),
    "stripe_secrets": webhook_secrets,
    "github_secrets": webhook_secrets,
    "partner_secrets": webhook_secrets,
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
    module(
        "payments.models",
        Payment=Payment,
        LedgerEntry=LedgerEntry,
        ReceiptEmail=ReceiptEmail,
        models=models,
    )
    module("payments.serializers", PaymentSerializer=PaymentSerializer)
    module("payments.reconcile", ask_the_provider=ask_the_provider)
    module("billing.models", Invoice=Refund)
    module("payments", provider=provider)  # a package by now: it holds the modules above
