"""Idempotent tasks of Django's Tasks framework, for django-tasks-db's ``db_worker``.

A worker (``manage.py db_worker --backend database``) imports them by their module path. The
effects are rows in the test database (atomic mode) and lines appended to a file (lease mode: an
effect outside the database).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from django_idempotency.django_tasks import idempotent_task
from tests.testapp.models import Refund

LEASE_TIMEOUT = 2.0


def hold_while(path: str | None) -> None:
    """Stay in the body while ``path`` exists (a test kills the worker meanwhile)."""
    deadline = time.monotonic() + 30
    while path and Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def mark(path: str | None, line: str) -> None:
    if path:
        with Path(path).open("a") as file:
            file.write(line + "\n")


# A run waits for the killed run's transaction to be rolled back by the database.
@idempotent_task(key=lambda label, *_, **__: label, backend="database", wait_timeout=10.0)
def refund(
    label: str, amount: int, *, started: str | None = None, hold: str | None = None
) -> dict[str, object]:
    """Record a refund (the effect: a row committed with the key); return what it did."""
    Refund.objects.create(event_id=label, amount=amount)
    mark(started, "started")
    hold_while(hold)
    return {"label": label, "amount": amount, "run": uuid.uuid4().hex}


def recover_receipt(
    payment: str, effects: str, *, key: str, attempt: int, **_: object
) -> dict[str, object] | None:
    """Ask the "mail provider" whether the receipt went out before the last run died."""
    sent = Path(effects).read_text().split() if Path(effects).exists() else []
    return {"payment": payment, "recovered": True} if payment in sent else None


@idempotent_task(
    key=lambda payment, *_, **__: payment,
    mode="lease",
    lease_timeout=LEASE_TIMEOUT,
    recover=recover_receipt,
    backend="database",
    wait_timeout=0.2,
    busy_countdown=0.3,
)
def send_receipt(
    payment: str, effects: str, *, started: str | None = None, hold: str | None = None
) -> dict[str, object]:
    """Send a receipt (the effect: a line in a file, which no transaction takes back)."""
    mark(effects, payment)
    mark(started, "started")
    hold_while(hold)
    return {"payment": payment, "recovered": False}
