"""Outbox dispatchers for the tests, and the inbox handler that consumes their webhooks."""

from __future__ import annotations

import logging
import os
import threading
import time

from django.conf import settings

from django_idempotency.inbox import inbox_handler
from django_idempotency.outbox import WebhookDispatcher, outbox_dispatcher, register_dispatcher
from tests.testapp.models import Refund

logger = logging.getLogger("tests.handlers")

#: The message ids the recording dispatcher was called with, in order.
RECORDED: list[str] = []
_lock = threading.Lock()


@outbox_dispatcher("tests.recorded")
def record(message):
    with _lock:
        RECORDED.append(str(message.message_id))


@outbox_dispatcher("tests.failing")
def fail_at_first(message):
    """Fail the first ``fail_times`` attempts (all of them with "always"), then record."""
    fail_times = message.payload.get("fail_times", 0)
    if fail_times == "always" or message.attempts <= fail_times:
        msg = f"the consumer is down (attempt {message.attempts})"
        raise ConnectionError(msg)
    record(message)


@outbox_dispatcher("tests.slow_refund")
def slow_refund(message):
    """Take ``payload["seconds"]``, then refund: a delivery that a process of its own can see."""
    time.sleep(message.payload.get("seconds", 0))
    Refund.objects.create(event_id=str(message.message_id), amount=message.attempts)


# A relay in another process sends payment.captured to the URL the test gives it.
if url := os.environ.get("TEST_OUTBOX_URL"):
    register_dispatcher(
        "payment.captured", WebhookDispatcher(url, lambda: settings.TEST_WEBHOOK_SECRETS)
    )


@inbox_handler("outbox", "payment.captured")
def payment_captured(event):
    logger.info("refunding for %s", event.event_id)
    Refund.objects.create(event_id=event.event_id, amount=event.payload["data"]["amount"])
