"""The retry queue the inbox and the outbox share: how often a job runs, what a failure leaves."""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from django_idempotency.exceptions import PermanentError
from django_idempotency.models import OutboxMessage
from django_idempotency.queue.schedule import (
    ERROR_MAX_LENGTH,
    RetrySchedule,
    change_unclaimed,
    due,
    error_text,
    stopped_text,
)
from tests.factories import OutboxMessageFactory

POLICY = RetrySchedule(max_attempts=3, delay=timedelta(seconds=30), max_delay=timedelta(minutes=1))


class LedgerError(Exception):
    pass


def test_an_error_is_kept_as_its_type_and_message():
    assert error_text(LedgerError("the ledger is unavailable")) == (
        "LedgerError: the ledger is unavailable"
    )


def test_a_long_error_message_is_cut_to_the_bound():
    text = error_text(LedgerError("x" * 10 * ERROR_MAX_LENGTH))

    assert len(text) == ERROR_MAX_LENGTH
    assert text.startswith("LedgerError: xxx")


@pytest.mark.parametrize(("attempt", "bound"), [(1, 30.0), (2, 60.0), (3, 60.0), (10**6, 60.0)])
def test_the_retry_delay_is_drawn_between_zero_and_a_doubling_capped_bound(attempt, bound):
    # Full jitter: both ends of the range are reachable, so failures that came together spread.
    assert POLICY.retry_delay(attempt, lambda: 0.0) == 0.0
    assert POLICY.retry_delay(attempt, lambda: 0.5) == bound / 2
    assert bound * 0.99 < POLICY.retry_delay(attempt, lambda: math.nextafter(1.0, 0.0)) <= bound


def test_attempts_are_spent_once_the_limit_has_started():
    assert [POLICY.spent(attempts) for attempts in range(5)] == [False, False, False, True, True]


def test_a_failure_is_retried_until_the_last_attempt_and_a_permanent_error_at_once():
    assert [POLICY.gives_up(attempt, LedgerError()) for attempt in (1, 2, 3)] == [
        False,
        False,
        True,
    ]
    assert POLICY.gives_up(1, PermanentError("payment 7 does not exist"))


def test_a_job_dead_without_an_outcome_says_which_attempt_its_runner_died_in():
    assert stopped_text("worker", 2) == "The worker stopped during attempt 2."


@contextmanager
def held(row):
    """Hold ``row``'s lock in another connection, as an attempt in progress does."""
    locked, release = threading.Event(), threading.Event()

    def attempt():
        try:
            with transaction.atomic():
                OutboxMessage.objects.select_for_update().get(pk=row.pk)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=attempt)
    thread.start()
    assert locked.wait(5)
    try:
        yield
    finally:
        release.set()
        thread.join()


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_due_rows_are_those_whose_time_has_come_and_that_no_attempt_holds():
    free, busy = OutboxMessageFactory(), OutboxMessageFactory()
    OutboxMessageFactory(scheduled=True)

    with held(busy), transaction.atomic():
        rows = due(OutboxMessage.objects.all(), timezone.now())
        taken = list(rows.values_list("pk", flat=True))

    assert taken == [free.pk]


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_a_persons_change_leaves_a_row_mid_attempt_alone():
    free, busy = OutboxMessageFactory(dead=True), OutboxMessageFactory(dead=True)

    with held(busy), transaction.atomic():
        rows = change_unclaimed(OutboxMessage.objects.all(), {"status": "pending"}, "topic")

    assert rows == [{"pk": free.pk, "status": "dead", "topic": "tests.recorded"}]
    statuses = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert statuses == {free.pk: "pending", busy.pk: "dead"}
