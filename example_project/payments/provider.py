"""A stand-in for a payment provider: slow enough for duplicates to overlap; sends webhooks."""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from django.conf import settings

from django_idempotency.inbox import StripeSignature

# Both are environment knobs so that a test serving the project can make the provider slower
# than a lease, before or after the money is taken.
LATENCY = float(os.environ.get("EXAMPLE_PROVIDER_LATENCY", "0.2"))
"""Seconds each authorization or charge takes before it happens (``EXAMPLE_PROVIDER_LATENCY``)."""
DELAY_AFTER_CHARGE = float(os.environ.get("EXAMPLE_PROVIDER_DELAY_AFTER_CHARGE", "0"))
"""Seconds a charge takes to answer once the money is taken
(``EXAMPLE_PROVIDER_DELAY_AFTER_CHARGE``)."""


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
    time.sleep(DELAY_AFTER_CHARGE)
    return record.reference


def find_charge(idempotency_key: str) -> str | None:
    """The reference of the charge made with this key, if the provider has one."""
    from payments.models import ProviderCharge  # noqa: PLC0415

    return (
        ProviderCharge.objects.filter(idempotency_key=idempotency_key)
        .values_list("reference", flat=True)
        .first()
    )


def refund_events(refund_id: int) -> list[dict[str, Any]]:
    """The events the provider sends about a refund, in the order they happened."""
    return [
        {
            "id": f"evt_{uuid.uuid4().hex[:16]}",
            "type": f"refund.{status}",
            "data": {"refund": refund_id, "sequence": sequence},
        }
        for sequence, status in enumerate(["pending", "succeeded"], start=1)
    ]


def signed(event: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one delivery of ``event``, signed as the provider signs."""
    body = json.dumps(event).encode()
    return body, StripeSignature(settings.PROVIDER_WEBHOOK_SECRETS).sign(body)
