"""Idempotent tasks and their Celery app, for a real worker over Redis or RabbitMQ.

A worker runs ``celery -A tests.task_worker worker`` with ``TEST_TASK_BROKER`` (``redis`` or
``rabbitmq``) and the test database's name in its environment. The effects are rows in the test
database (atomic mode) and lines appended to a file (lease mode: an effect outside the database).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from celery import Celery  # noqa: E402

from django_idempotency.celery import idempotent_task  # noqa: E402
from django_idempotency.core.correlation import get_correlation_id  # noqa: E402
from tests.testapp.models import Refund  # noqa: E402

REDIS_URL = f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_CELERY_DB', '14')}"
BROKERS = {"redis": REDIS_URL, "rabbitmq": "amqp://guest:guest@127.0.0.1:5672//"}
# Parallel runs on one machine keep apart by their queue: each test run names its own (a worker
# it starts inherits the name), so that no run's workers take, or purge, another run's tasks.
QUEUE = os.environ.setdefault("TEST_TASK_QUEUE", f"django-idempotency-tasks-{uuid.uuid4().hex}")
# How long a Redis broker leaves a message that a worker took but never acknowledged (it died)
# before another worker gets it; RabbitMQ hands it over when the dead worker's connection drops.
VISIBILITY_TIMEOUT = 3
LEASE_TIMEOUT = 2.0


def make_app(broker: str) -> Celery:
    app = Celery("idempotent-tasks", broker=BROKERS[broker], backend=REDIS_URL)
    app.conf.task_default_queue = QUEUE
    app.conf.broker_transport_options = {
        "visibility_timeout": VISIBILITY_TIMEOUT,
        # Look for such messages every second, not every 100 s.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed while it looked keeps the look's lock in Redis until this expires (5
        # minutes by default): no other worker could put the killed one's message back.
        "unacked_mutex_expire": 5,
    }
    app.conf.broker_connection_retry_on_startup = True
    app.conf.worker_prefetch_multiplier = 1
    app.conf.result_extended = True  # a result names the worker that ran it
    return app


app = make_app(os.environ.get("TEST_TASK_BROKER", "redis"))


def hold_while(path: str | None) -> None:
    """Stay in the body while ``path`` exists (a test kills the worker meanwhile)."""
    deadline = time.monotonic() + 30
    while path and Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def mark(path: str | None, line: str) -> None:
    if path:
        with Path(path).open("a") as file:
            file.write(line + "\n")


class Flaky(Exception):
    """The first attempts of ``refund`` raise this, until ``failures`` is used up."""


@idempotent_task(
    key=lambda label, *_, **__: label,
    name="tests.refund",
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(Flaky,),
    default_retry_delay=0.2,
    max_retries=5,
    wait_timeout=5.0,
)
def refund(
    label: str,
    amount: int,
    *,
    started: str | None = None,
    hold: str | None = None,
    pause: float = 0.0,
    failures: str | None = None,
) -> dict[str, object]:
    """Record a refund (the effect: a row committed with the key); return what it did."""
    Refund.objects.create(event_id=label, amount=amount)
    mark(started, "started")
    hold_while(hold)
    time.sleep(pause)
    if failures and Path(failures).exists() and Path(failures).read_text().strip():
        # Take one failure off the list, outside the transaction, and fail this attempt.
        lines = Path(failures).read_text().split()
        Path(failures).write_text("\n".join(lines[1:]))
        raise Flaky(lines[0])
    return {
        "label": label,
        "amount": amount,
        "run": uuid.uuid4().hex,
        "correlation_id": get_correlation_id(),
    }


def recover_receipt(
    payment: str, effects: str, *, key: str, attempt: int, **_: object
) -> dict[str, object] | None:
    """Ask the "mail provider" whether the receipt went out before the last delivery died."""
    sent = Path(effects).read_text().split() if Path(effects).exists() else []
    return {"payment": payment, "recovered": True, "attempt": attempt} if payment in sent else None


@idempotent_task(
    key=lambda payment, *_, **__: payment,
    mode="lease",
    lease_timeout=LEASE_TIMEOUT,
    recover=recover_receipt,
    name="tests.send_receipt",
    acks_late=True,
    reject_on_worker_lost=True,
    wait_timeout=1.0,
    busy_countdown=0.5,
    max_retries=40,
)
def send_receipt(
    payment: str, effects: str, *, started: str | None = None, hold: str | None = None
) -> dict[str, object]:
    """Send a receipt (the effect: a line in a file, which no transaction takes back)."""
    mark(effects, payment)
    mark(started, "started")
    hold_while(hold)
    return {"payment": payment, "recovered": False}
