"""Webhook receivers and inbox handlers for the tests."""

from __future__ import annotations

import time

from django.conf import settings
from django.db import OperationalError, connection

from django_idempotency.exceptions import PermanentError
from django_idempotency.inbox import ANY_TYPE, WebhookReceiverView, inbox_handler
from django_idempotency.signing import GitHubSignature, StandardWebhooksSignature, StripeSignature
from tests.testapp.models import Refund


def secrets() -> list[str]:
    return settings.TEST_WEBHOOK_SECRETS


class TestWebhook(WebhookReceiverView):
    source = "tests"
    verifier = StandardWebhooksSignature(secrets)


class SmallWebhook(TestWebhook):
    max_payload_size = 64


class StripeWebhook(WebhookReceiverView):
    source = "stripe"
    verifier = StripeSignature(secrets)


class OutboxWebhook(WebhookReceiverView):
    """Where the outbox's webhook dispatcher delivers, in the tests."""

    source = "outbox"
    verifier = StandardWebhooksSignature(secrets)


class GitHubWebhook(WebhookReceiverView):
    source = "github"
    verifier = GitHubSignature(secrets)
    event_id_header = "X-GitHub-Delivery"
    event_type_header = "X-GitHub-Event"


@inbox_handler("tests", "refund.succeeded")
def refund_succeeded(event):
    """Record a refund; the payload can ask it to fail, always or for the first attempts."""
    data = event.payload["data"]
    if data.get("lose_database") and event.attempts == 1:
        lose_database()
    if data.get("fail") == "permanent":
        msg = f"payment {data.get('payment')} does not exist"
        raise PermanentError(msg)
    if data.get("fail") == "always" or event.attempts <= data.get("fail_times", 0):
        msg = f"the ledger is unavailable (attempt {event.attempts})"
        raise RuntimeError(msg)
    Refund.objects.create(event_id=event.event_id, amount=data["amount"])
    if event.attempts == 1:
        # After the write: a worker killed while sleeping dies with the refund uncommitted.
        time.sleep(data.get("sleep_first", 0))


@inbox_handler("stripe", ANY_TYPE)
@inbox_handler("github", ANY_TYPE)
def acknowledge(event):
    """Take any event of these senders and do nothing with it."""


def lose_database():
    """Lose the database under the handler: the server ends the session, as a failover would."""
    if connection.vendor != "postgresql":
        msg = "server closed the connection unexpectedly"
        raise OperationalError(msg)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
