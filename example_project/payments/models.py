from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils.translation import gettext_lazy as _


class Payment(models.Model):
    """Money taken from a customer, in minor units (cents) as Stripe counts it."""

    id = models.BigAutoField(primary_key=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.PROTECT,
        related_name="payments",
        verbose_name=_("owner"),
    )
    amount = models.PositiveBigIntegerField(
        _("amount"), help_text=_("In minor units: 1000 = 10.00.")
    )
    currency = models.CharField(_("currency"), max_length=3, help_text=_("ISO 4217, lower case."))
    description = models.CharField(_("description"), max_length=255, blank=True)
    metadata = models.JSONField(_("metadata"), default=dict, blank=True)
    # The payment's ETag: updates with If-Match compare and advance it (ConditionalMixin).
    version = models.PositiveIntegerField(_("version"), default=1, editable=False)
    amount_refunded = models.PositiveBigIntegerField(_("amount refunded"), default=0)
    # One payment per charge at the provider: a second record of the same charge is refused by
    # the database, whatever the code above it does.
    provider_reference = models.CharField(_("provider reference"), max_length=64, unique=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("payment")
        verbose_name_plural = _("payments")
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"Payment {self.pk}: {self.amount} {self.currency}"

    @property
    def refundable(self) -> int:
        """What is left to refund, in minor units."""
        return self.amount - self.amount_refunded


class ProviderStatus(models.TextChoices):
    PENDING = "pending", _("pending")
    SUCCEEDED = "succeeded", _("succeeded")


class Refund(models.Model):
    """Money given back on a payment: part of it or all of it."""

    id = models.BigAutoField(primary_key=True)
    payment = models.ForeignKey(
        Payment, on_delete=models.PROTECT, related_name="refunds", verbose_name=_("payment")
    )
    amount = models.PositiveBigIntegerField(_("amount"), help_text=_("In minor units."))
    reason = models.CharField(_("reason"), max_length=255, blank=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    # What the provider reports, through its webhooks.
    provider_status = models.CharField(
        _("provider status"), max_length=16, choices=ProviderStatus.choices, blank=True
    )
    provider_sequence = models.PositiveIntegerField(
        _("provider sequence"),
        default=0,
        help_text=_("The sequence number of the newest provider event applied."),
    )

    class Meta:
        verbose_name = _("refund")
        verbose_name_plural = _("refunds")
        ordering = ["-id"]

    def __str__(self) -> str:
        return (
            f"Refund {self.pk}: {self.amount} {self.payment.currency} of payment {self.payment_id}"
        )


class LedgerEntry(models.Model):
    """One line of the books, written in the same transaction as the payment or refund.

    A duplicate request that slipped through would show here as a second line.
    """

    class Kind(models.TextChoices):
        CHARGE = "charge", _("charge")
        REFUND = "refund", _("refund")

    id = models.BigAutoField(primary_key=True)
    payment = models.ForeignKey(
        Payment, on_delete=models.PROTECT, related_name="ledger_entries", verbose_name=_("payment")
    )
    refund = models.OneToOneField(
        Refund,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="ledger_entry",
        verbose_name=_("refund"),
    )
    kind = models.CharField(_("kind"), max_length=16, choices=Kind.choices)
    amount = models.BigIntegerField(
        _("amount"), help_text=_("In minor units: positive for a charge, negative for a refund.")
    )
    currency = models.CharField(_("currency"), max_length=3)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("ledger entry")
        verbose_name_plural = _("ledger entries")
        ordering = ["-id"]

    def __str__(self) -> str:
        kind = self.get_kind_display()
        return f"{kind} {self.amount:+d} {self.currency} (payment {self.payment_id})"


class ProviderCharge(models.Model):
    """The card provider's own record of a charge: its side, not ours.

    A real provider keeps these on its servers; the example keeps them in a database because it
    has no other server: on SQLite one of their own (``provider.LedgerRouter``), elsewhere the
    project's. Like Stripe, the provider honours an idempotency key: charging twice
    with one key returns the first charge.
    """

    id = models.BigAutoField(primary_key=True)
    idempotency_key = models.CharField(_("idempotency key"), max_length=300, unique=True)
    reference = models.CharField(_("reference"), max_length=64, unique=True)
    amount = models.PositiveBigIntegerField(_("amount"))
    currency = models.CharField(_("currency"), max_length=3)
    description = models.CharField(_("description"), max_length=255, blank=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("provider charge")
        verbose_name_plural = _("provider charges")

    def __str__(self) -> str:
        return f"{self.reference}: {self.amount} {self.currency}"


class CustomerNotice(models.Model):
    """A message to the customer, sent when the provider confirms a refund.

    A webhook processed twice would show here as a second notice.
    """

    id = models.BigAutoField(primary_key=True)
    refund = models.ForeignKey(
        Refund, on_delete=models.PROTECT, related_name="notices", verbose_name=_("refund")
    )
    message = models.CharField(_("message"), max_length=255)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)

    class Meta:
        verbose_name = _("customer notice")
        verbose_name_plural = _("customer notices")
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.message


class ReceiptEmail(models.Model):
    """The receipt e-mailed for a captured payment, on its ``payment.captured`` event.

    An event processed twice would show here as a second e-mail.
    """

    id = models.BigAutoField(primary_key=True)
    payment = models.ForeignKey(
        Payment, on_delete=models.PROTECT, related_name="receipts", verbose_name=_("payment")
    )
    event_id = models.CharField(_("event id"), max_length=255)
    sent_at = models.DateTimeField(_("sent at"), auto_now_add=True)

    class Meta:
        verbose_name = _("receipt e-mail")
        verbose_name_plural = _("receipt e-mails")
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"Receipt for payment {self.payment_id}"
