"""The retry queue's attempts, which the inbox's events and the outbox's messages share: one
dead-letter rule, driven here through each one's own entry points."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings
from django.utils import timezone

from django_idempotency.inbox import process, receive
from django_idempotency.inbox.handlers import register_handler
from django_idempotency.inbox.handlers import unregister as unregister_handler
from django_idempotency.models import InboxEvent, OutboxMessage
from django_idempotency.outbox import publish, register_dispatcher, relay
from django_idempotency.outbox.dispatchers import unregister as unregister_dispatcher

pytestmark = pytest.mark.django_db(transaction=True)


class _Dies(BaseException):
    """Leaves the attempt as a kill would: nothing after it runs."""


def fails_then_dies(job):
    if job.attempts == 1:
        msg = f"the consumer is down (attempt {job.attempts})"
        raise ConnectionError(msg)
    raise _Dies


class Inbox:
    runner = "worker"

    def __init__(self):
        register_handler("tests.queue", "job", fails_then_dies)

    def close(self):
        unregister_handler("tests.queue", "job")

    def start(self):
        """Record a job; its first attempt fails. Return its row."""
        return receive("tests.queue", "evt_1", "job", {}).event

    def attempt(self, row):
        process(row.pk)

    def row(self, row):
        return InboxEvent.objects.get(pk=row.pk)


class Outbox:
    runner = "relay"

    def __init__(self):
        register_dispatcher("tests.queue", fails_then_dies)
        self.now = timezone.now()

    def close(self):
        unregister_dispatcher("tests.queue")

    def start(self):
        """Publish a job; its first attempt, relayed once it commits, fails. Return its row."""
        return publish("tests.queue", {})

    def attempt(self, row):
        # Later than any retry or lease.
        self.now += timedelta(days=1)
        relay(now=lambda: self.now)

    def row(self, row):
        return OutboxMessage.objects.get(pk=row.pk)


@pytest.fixture(params=[Inbox, Outbox])
def jobs(request):
    side = request.param()
    yield side
    side.close()


def test_a_job_out_of_attempts_at_its_claim_keeps_the_error_of_its_last_attempt(jobs):
    row = jobs.start()
    # Then an operator lowers the limit under the attempts it has had.
    with override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 1, "OUTBOX_MAX_ATTEMPTS": 1}):
        jobs.attempt(row)

    row = jobs.row(row)
    assert (row.status, row.attempts) == ("dead", 1)
    assert row.last_error == "ConnectionError: the consumer is down (attempt 1)"


@override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 2, "OUTBOX_MAX_ATTEMPTS": 2})
def test_a_job_whose_runner_died_during_its_last_attempt_says_so_over_an_earlier_error(jobs):
    row = jobs.start()
    with pytest.raises(_Dies):
        jobs.attempt(row)

    jobs.attempt(row)

    row = jobs.row(row)
    assert (row.status, row.attempts) == ("dead", 2)
    assert row.last_error == f"The {jobs.runner} stopped during attempt 2."
