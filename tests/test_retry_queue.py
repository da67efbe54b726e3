"""The retry queue the inbox and the outbox share: how often a job runs, what a failure leaves."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from django_idempotency.exceptions import PermanentError
from django_idempotency.retry_queue import ERROR_MAX_LENGTH, RetryPolicy, error_text, stopped_text

POLICY = RetryPolicy(max_attempts=3, delay=timedelta(seconds=30), max_delay=timedelta(minutes=1))


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
