"""The payments API. Creating a payment or a refund is safe to retry with an Idempotency-Key.

``IdempotentMixin`` goes before the DRF view class in the bases, in any order with
``ConditionalMixin``. It runs the handler inside the transaction that holds the key: the payment
(or refund) and its ledger entry commit together with the stored response, or not at all.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.contrib.auth import get_user_model
from django.db import transaction
from rest_framework import generics, status
from rest_framework.exceptions import ValidationError
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from django_idempotency.drf import ConditionalMixin, IdempotentMixin
from django_idempotency.keys import key_of
from django_idempotency.outbox import publish
from django_idempotency.reconcile import ExpiredKey, NothingHappened, Reconciled
from payments import provider
from payments.models import LedgerEntry, Payment, Refund
from payments.serializers import PaymentSerializer, PaymentUpdateSerializer, RefundSerializer

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from rest_framework.request import Request

    from django_idempotency.keys import ScopedKey


def record_capture(serializer: PaymentSerializer, owner: Any, reference: str) -> Payment:
    """Save a card payment and announce it: the message commits with the payment, or neither."""
    with transaction.atomic():
        payment = record_payment(serializer, owner, reference)
        publish(
            "payment.captured",
            {"payment": payment.pk, "amount": payment.amount, "currency": payment.currency},
            ordering_key=f"payment-{payment.pk}",
        )
    return payment


def record_payment(serializer: PaymentSerializer, owner: Any, reference: str) -> Payment:
    """Save the payment and its ledger entry."""
    payment = serializer.save(owner=owner, provider_reference=reference)
    LedgerEntry.objects.create(
        payment=payment,
        kind=LedgerEntry.Kind.CHARGE,
        amount=payment.amount,
        currency=payment.currency,
    )
    return payment


class PaymentList(IdempotentMixin, generics.ListCreateAPIView):
    """List your payments, or take one: ``POST`` with an ``Idempotency-Key`` header."""

    serializer_class = PaymentSerializer

    def get_queryset(self) -> QuerySet[Payment]:
        return Payment.objects.filter(owner=self.request.user)

    def perform_create(self, serializer: PaymentSerializer) -> None:
        data = serializer.validated_data
        reference = provider.authorize(data["amount"], data["currency"])
        record_payment(serializer, self.request.user, reference)


class PaymentDetail(ConditionalMixin, IdempotentMixin, generics.RetrieveUpdateAPIView):
    """Read a payment (with its ``ETag``), or change its description and metadata.

    Send the ``ETag`` you read back in ``If-Match``: if someone changed the payment since, the
    update is refused with 412 instead of silently overwriting their change. A ``PATCH`` sent
    again with its ``Idempotency-Key`` is replayed rather than refused.
    """

    etag_version_field = "version"
    idempotency_required = False

    def get_queryset(self) -> QuerySet[Payment]:
        return Payment.objects.filter(owner=self.request.user)

    def get_serializer_class(self) -> type[PaymentSerializer]:
        if self.request.method in {"PUT", "PATCH"}:
            return PaymentUpdateSerializer
        return PaymentSerializer


class RefundList(IdempotentMixin, generics.ListCreateAPIView):
    """List your refunds, or refund part or all of a payment (with an ``Idempotency-Key``).

    A refund larger than what is left is a 400 once the refund was accepted and the payment
    locked: a business answer, so this view stores it with the key and replays it, like a
    success. Only a 422 here would say the request itself was invalid (by default a 400 says so
    too, and is not kept).
    """

    serializer_class = RefundSerializer
    idempotency_invalid_request_status_codes = (422,)

    def get_queryset(self) -> QuerySet[Refund]:
        return Refund.objects.filter(payment__owner=self.request.user).select_related("payment")

    def perform_create(self, serializer: RefundSerializer) -> None:
        # Lock the payment: two refunds sent with different keys must not both take what is left.
        payment = Payment.objects.select_for_update().get(
            pk=serializer.validated_data["payment"].pk
        )
        amount = serializer.validated_data.get("amount", payment.refundable)
        if not 0 < amount <= payment.refundable:
            detail = (
                f"The refund ({amount}) is more than what is left to refund on payment "
                f"{payment.pk} ({payment.refundable} {payment.currency})."
            )
            raise ValidationError({"amount": [detail]})
        refund = serializer.save(amount=amount)
        payment.amount_refunded += amount
        payment.save(update_fields=["amount_refunded"])
        LedgerEntry.objects.create(
            payment=payment,
            refund=refund,
            kind=LedgerEntry.Kind.REFUND,
            amount=-amount,
            currency=payment.currency,
        )


class RefundDetail(generics.RetrieveAPIView):
    serializer_class = RefundSerializer

    def get_queryset(self) -> QuerySet[Refund]:
        return Refund.objects.filter(payment__owner=self.request.user).select_related("payment")


class WorkerDied(BaseException):
    """The demo's stand-in for a worker killed right after the provider charged.

    A ``BaseException`` passes every ``except Exception`` on its way out, as the death of the
    process would: nothing of the request runs after it, not even the release of its key, whose
    lease is left to run out.
    """


def owner_of(scope: str) -> Any:
    """The user a key belongs to: the default scope starts with ``<model label>:<pk>``."""
    principal = scope.split(" ", 1)[0]
    return get_user_model().objects.get(pk=principal.rsplit(":", 1)[1])


def reconcile_charge(expired: ExpiredKey) -> Reconciled | NothingHappened:
    """What the sweeper is told about a charge whose request died: ask the provider.

    If the provider took the money, record the payment (once: its provider reference is unique,
    and the retry's recovery hook finds the same row) and answer what the view would have
    answered. The sweeper serves no request, so the payment's links are relative.
    """
    owner = owner_of(expired.scope)
    # The key the view gave the provider, whichever spelling of the client's key it was sent in.
    charge = provider.charge_made_with(expired.downstream_key)
    if charge is None:
        return NothingHappened()  # the provider never charged: the retry charges
    payment = Payment.objects.filter(provider_reference=charge.reference).first()
    if payment is None:
        data = {
            "amount": charge.amount,
            "currency": charge.currency,
            "description": charge.description,
        }
        serializer = PaymentSerializer(data=data, context={"request": None})
        serializer.is_valid(raise_exception=True)
        payment = record_capture(serializer, owner, charge.reference)
    body = JSONRenderer().render(PaymentSerializer(payment, context={"request": None}).data)
    return Reconciled(status.HTTP_201_CREATED, {"Content-Type": "application/json"}, body)


class ChargeCard(IdempotentMixin, generics.CreateAPIView):
    """Charge a card at the provider: an effect outside our database, so in lease mode.

    The key is committed before the provider is called, and the provider gets a key derived
    from ours. The payment that records the charge commits with the key's completion, or not at
    all. If a request dies after the provider took the money, the sweeper asks the provider
    (``reconcile_charge``) once the lease ran out, and stores the payment it records as the
    key's answer; a retry that comes first asks the provider itself, through the recovery hook.
    Either way the card is not charged again: the payment's unique provider reference refuses a
    second record of one charge.
    """

    serializer_class = PaymentSerializer
    idempotency_mode = "lease"
    idempotency_reconcile = "payments.views.reconcile_charge"

    def provider_key(self) -> str:
        """The key the provider gets: the same for every spelling of the client's key, and
        never the same for two users' equal keys. Never build it from the raw header."""
        key = key_of(self.request)
        if key is None:
            # Only with the library switched off (ENABLED): then nothing protects a retry.
            return f"unprotected-{uuid.uuid4()}"
        return key.downstream_key

    def perform_create(self, serializer: PaymentSerializer) -> None:
        data = serializer.validated_data
        reference = provider.charge(
            data["amount"],
            data["currency"],
            idempotency_key=self.provider_key(),
            description=data.get("description", ""),
        )
        crash = self.request.headers.get("X-Demo-Crash")
        if crash == "die":
            raise WorkerDied
        if crash:
            # A worker that fails (an exception) after the charge: the key is released.
            msg = "the worker died after the charge"
            raise RuntimeError(msg)
        record_capture(serializer, self.request.user, reference)

    def recover_idempotent_request(
        self, request: Request, *, key: ScopedKey, attempt: int
    ) -> Response | None:
        reference = provider.find_charge(key.downstream_key)
        if reference is None:
            return None  # the provider never charged: run the view again
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        payment = Payment.objects.filter(provider_reference=reference).first()
        payment = payment or record_capture(serializer, request.user, reference)
        return Response(self.get_serializer(payment).data, status=status.HTTP_201_CREATED)
