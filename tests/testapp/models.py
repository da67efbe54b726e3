from __future__ import annotations

from django.conf import settings
from django.db import models


class Payment(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True)
    amount = models.PositiveIntegerField()
    currency = models.CharField(max_length=3, default="EUR")
    # What a downstream provider would keep: the idempotency key it was called with.
    reference = models.CharField(max_length=255, blank=True, default="")
    # JSON from the request, stored as sent: each database has its own limits on what it holds.
    metadata = models.JSONField(default=dict, blank=True)

    class Meta:
        # One payment per provider charge, as a real project records it.
        constraints = [
            models.UniqueConstraint(
                fields=["reference"],
                condition=~models.Q(reference=""),
                name="testapp_payment_unique_reference",
            )
        ]

    def __str__(self) -> str:
        return f"{self.amount} {self.currency}"


class Charge(models.Model):
    """A downstream provider's charge: it commits on its own, whatever our transaction does."""

    key = models.CharField(max_length=255, unique=True)
    amount = models.PositiveIntegerField()
    calls = models.PositiveIntegerField(default=0)  # how many times the provider was asked

    def __str__(self) -> str:
        return f"charge {self.key}"


class LedgerEntry(models.Model):
    payment = models.ForeignKey(Payment, on_delete=models.CASCADE)
    amount = models.IntegerField()

    def __str__(self) -> str:
        return f"{self.amount} for payment {self.payment_id}"


class Refund(models.Model):
    """The effect of the inbox's test handler: one row each time it runs to the end."""

    event_id = models.CharField(max_length=255)
    amount = models.IntegerField()

    def __str__(self) -> str:
        return f"refund {self.amount} for {self.event_id}"


class Document(models.Model):
    """A resource updated with If-Match: its ETag is its version, or its representation's hash."""

    title = models.CharField(max_length=200)
    body = models.TextField(blank=True, default="")
    version = models.PositiveIntegerField(default=1)

    def __str__(self) -> str:
        return self.title
