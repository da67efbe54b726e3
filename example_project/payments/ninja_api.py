"""The payments API's Django Ninja routes: ``POST /ninja/payments/``, safe to retry, and the same
from an ``async def`` operation, ``POST /ninja/async-payments/``.

Each takes a payment as ``POST /api/payments/`` does, through ``django_idempotency.ninja``: the key
is resolved after Ninja authenticates the caller, the payment and its ledger entry commit with the
stored response, and the schema at ``/ninja/openapi.json`` documents the ``Idempotency-Key``
header and its problem answers.
"""

from __future__ import annotations

from datetime import datetime  # noqa: TC003 - Ninja reads the annotations at runtime
from typing import Annotated, Any

from django.contrib.auth import authenticate
from django.http import HttpRequest  # noqa: TC002 - Ninja reads the annotations at runtime
from ninja import Field, NinjaAPI, Schema, Status
from ninja.security import HttpBasicAuth, django_auth
from pydantic import AfterValidator

from django_idempotency.ninja import idempotent
from payments import provider
from payments.models import LedgerEntry, Payment
from payments.validation import metadata_problem, text_problem


class BasicAuth(HttpBasicAuth):
    """HTTP Basic, as the DRF views accept it."""

    def authenticate(self, request: HttpRequest, username: str, password: str) -> Any:
        return authenticate(request, username=username, password=password)


def _storable_text(text: str) -> str:
    if (problem := text_problem(text)) is not None:
        raise ValueError(problem)
    return text


def _storable_metadata(value: dict[str, Any]) -> dict[str, Any]:
    if (problem := metadata_problem(value)) is not None:
        raise ValueError(problem)
    return value


class PaymentIn(Schema):
    amount: Annotated[int, Field(ge=1, le=99_999_999)]
    currency: Annotated[str, Field(pattern=r"^[A-Za-z]{3}$")]
    # What DRF's CharField and the serializer refuse, Ninja's schema refuses too: a 422, where
    # the database would refuse the write with a 500.
    description: Annotated[str, Field(max_length=255), AfterValidator(_storable_text)] = ""
    metadata: Annotated[dict[str, Any], AfterValidator(_storable_metadata)] = {}


class PaymentOut(Schema):
    id: int
    amount: int
    currency: str
    description: str
    metadata: dict[str, Any]
    version: int
    amount_refunded: int
    provider_reference: str
    created_at: datetime


api = NinjaAPI(
    title="Payments (Django Ninja)",
    urls_namespace="ninja",
    auth=[BasicAuth(), django_auth],
)


def _payment(request: HttpRequest, payload: PaymentIn, reference: str) -> dict[str, Any]:
    return {
        "owner": request.auth,  # type: ignore[attr-defined] # set by Ninja's authentication
        "amount": payload.amount,
        "currency": payload.currency.lower(),
        "description": payload.description,
        "metadata": payload.metadata,
        "provider_reference": reference,
    }


def _ledger_entry(payment: Payment) -> dict[str, Any]:
    return {
        "payment": payment,
        "kind": LedgerEntry.Kind.CHARGE,
        "amount": payment.amount,
        "currency": payment.currency,
    }


@api.post("/payments/", response={201: PaymentOut})
@idempotent()
def create_payment(request: HttpRequest, payload: PaymentIn) -> Status[Payment]:
    """Take a payment: send an ``Idempotency-Key``, and send it again with each retry."""
    reference = provider.authorize(payload.amount, payload.currency)
    payment = Payment.objects.create(**_payment(request, payload, reference))
    LedgerEntry.objects.create(**_ledger_entry(payment))
    return Status(201, payment)


@api.post("/async-payments/", response={201: PaymentOut})
@idempotent()
async def create_payment_async(request: HttpRequest, payload: PaymentIn) -> Status[Payment]:
    """Take a payment, from an ``async def`` operation: the same as ``POST /payments/``.

    Its queries (Django's async ORM) join the transaction that holds the key.
    """
    reference = await provider.aauthorize(payload.amount, payload.currency)
    payment = await Payment.objects.acreate(**_payment(request, payload, reference))
    await LedgerEntry.objects.acreate(**_ledger_entry(payment))
    return Status(201, payment)
