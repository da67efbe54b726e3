"""A stand-in for a payment provider, slow enough for concurrent duplicates to overlap."""

from __future__ import annotations

import time
import uuid

LATENCY = 0.2
"""Seconds each authorization takes."""


def authorize(amount: int, currency: str) -> str:
    """Pretend to authorize ``amount`` and return the provider's reference for it.

    It runs inside the view's transaction, holding the key's row meanwhile. This fake has no
    effect outside the database, so a rollback undoes everything it did.
    """
    time.sleep(LATENCY)
    return f"auth_{uuid.uuid4().hex[:16]}"


def charge(amount: int, currency: str, *, idempotency_key: str) -> str:
    """Charge a card at the provider; the same key returns the first charge's reference.

    Its effect is outside our transaction: it commits at once, whatever happens to ours.
    """
    from payments.models import ProviderCharge  # noqa: PLC0415 - models load after settings

    time.sleep(LATENCY)
    record, _created = ProviderCharge.objects.get_or_create(
        idempotency_key=idempotency_key,
        defaults={
            "reference": f"ch_{uuid.uuid4().hex[:16]}",
            "amount": amount,
            "currency": currency,
        },
    )
    return record.reference


def find_charge(idempotency_key: str) -> str | None:
    """The reference of the charge made with this key, if the provider has one."""
    from payments.models import ProviderCharge  # noqa: PLC0415

    return (
        ProviderCharge.objects.filter(idempotency_key=idempotency_key)
        .values_list("reference", flat=True)
        .first()
    )
