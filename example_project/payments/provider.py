"""A stand-in for a payment provider: slow enough for duplicates to overlap; sends webhooks."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar, cast

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

from django_idempotency.signing import StripeSignature

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.models import Model

    from payments.models import ProviderCharge

T = TypeVar("T")

DATABASE = "provider"
"""The alias of the provider's own database, where the project has one (on SQLite)."""

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


async def aauthorize(amount: int, currency: str) -> str:
    """``authorize`` for an async view: the latency is awaited, and the event loop serves other
    requests meanwhile."""
    await asyncio.sleep(LATENCY)
    return f"auth_{uuid.uuid4().hex[:16]}"


class LedgerRouter:
    """Keep the provider's records in its own database, where the project has one.

    On SQLite a view in lease mode holds the database's one write lock while it calls the
    provider; a provider writing to that same file would wait for the view, which waits for it.
    Elsewhere (PostgreSQL, MariaDB) the records share the project's database.
    """

    def db_for_read(self, model: type[Model], **hints: Any) -> str | None:
        return DATABASE if _is_ledger(model) and DATABASE in settings.DATABASES else None

    db_for_write = db_for_read

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool | None:
        if DATABASE not in settings.DATABASES:
            return None
        ledger = app_label == "payments" and model_name == "providercharge"
        return ledger == (db == DATABASE)


def _is_ledger(model: type[Model]) -> bool:
    return model._meta.label == "payments.ProviderCharge"


def _elsewhere(work: Callable[[], T]) -> T:
    """Run ``work()`` on a database connection of its own, as the provider's system would.

    The provider's records commit at once, whatever happens to the transaction of the view
    that called it: that is what makes a charge an effect outside our database.
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # handed to the caller below
            result["error"] = exc
        finally:
            connections.close_all()  # this thread's: the project's, and the provider's own

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return cast("T", result["value"])


def charge(amount: int, currency: str, *, idempotency_key: str, description: str = "") -> str:
    """Charge a card at the provider; the same key returns the first charge's reference."""
    time.sleep(LATENCY)
    reference = _take(amount, currency, idempotency_key, description)
    time.sleep(DELAY_AFTER_CHARGE)
    return reference


async def acharge(
    amount: int, currency: str, *, idempotency_key: str, description: str = ""
) -> str:
    """``charge`` for an async view: the provider's delays are awaited, not slept through."""
    await asyncio.sleep(LATENCY)
    reference = await sync_to_async(_take)(amount, currency, idempotency_key, description)
    await asyncio.sleep(DELAY_AFTER_CHARGE)
    return reference


def _take(amount: int, currency: str, idempotency_key: str, description: str) -> str:
    """Take the money, once per key, in the provider's own records."""
    from payments.models import ProviderCharge  # noqa: PLC0415 - models load after settings

    record, _created = _elsewhere(
        lambda: ProviderCharge.objects.get_or_create(
            idempotency_key=idempotency_key,
            defaults={
                "reference": f"ch_{uuid.uuid4().hex[:16]}",
                "amount": amount,
                "currency": currency,
                "description": description,
            },
        )
    )
    return record.reference


def find_charge(idempotency_key: str) -> str | None:
    """The reference of the charge made with this key, if the provider has one."""
    found = charge_made_with(idempotency_key)
    return found.reference if found is not None else None


def charge_made_with(idempotency_key: str) -> ProviderCharge | None:
    """The charge made with this key, as the provider tells it (amount, currency, description)."""
    from payments.models import ProviderCharge  # noqa: PLC0415

    return _elsewhere(
        lambda: ProviderCharge.objects.filter(idempotency_key=idempotency_key).first()
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
