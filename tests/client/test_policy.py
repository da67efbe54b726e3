"""What may be retried and how long to wait (``client._policy``).

The retryable statuses, jitter, Retry-After, and the retry policy's settings.
"""

from __future__ import annotations

import email.utils
import random

import httpx
import pytest

from django_idempotency.backoff import exponential_bound
from django_idempotency.client import (
    RETRYABLE_STATUSES,
    CircuitBreakers,
    RetryBudgets,
    RetryPolicy,
    RetryTransport,
    retrying_session,
)
from django_idempotency.client._policy import parse_retry_after
from tests.client.helpers import KINDS, WALL, answer, call, make_policy

# --- what is retried --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 504, 599])
def test_every_retryable_status_is_retried(kind, status, server, fake):
    server.script.append(answer(status))

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 501, 505])
def test_other_client_errors_and_permanent_server_errors_are_not_retried(
    kind, status, server, fake
):
    server.script.append(answer(status, body=b"no"))

    result = call(kind, make_policy(fake), "GET", server.url())

    assert (result.status, result.body) == (status, b"no")
    assert len(server.seen) == 1
    assert fake.sleeps == []


def test_the_retryable_statuses():
    assert {408, 425, 429, 500, 502, 503, 504, 599} <= RETRYABLE_STATUSES
    assert not {200, 301, 400, 404, 409, 422, 501, 505} & RETRYABLE_STATUSES


@pytest.mark.parametrize("kind", KINDS)
def test_a_409_in_progress_with_retry_after_is_retried_with_the_same_key(kind, server, fake):
    # What a server running this library answers while the first request with the key runs.
    server.script.append(answer(409, {"Retry-After": "1"}, b'{"code":"idempotency.in_progress"}'))

    result = call(kind, make_policy(fake), "POST", server.url(), content=b"{}")

    assert result.status == 200
    assert fake.sleeps == [1.0]
    keys = [seen.headers["idempotency-key"] for seen in server.seen]
    assert len(keys) == 2
    assert keys[0] == keys[1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_409_without_retry_after_is_a_final_answer(kind, server, fake):
    server.script.append(answer(409, body=b"conflict"))

    result = call(kind, make_policy(fake), "POST", server.url(), content=b"{}")

    assert (result.status, result.body) == (409, b"conflict")
    assert len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_409_with_retry_after_but_no_key_is_not_retried(kind, server, fake):
    server.script.append(answer(409, {"Retry-After": "1"}))

    result = call(kind, make_policy(fake, add_keys=False), "POST", server.url(), content=b"{}")

    assert result.status == 409
    assert len(server.seen) == 1


# --- delays -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("jitter", "expected"),
    [
        ("full", [0.05, 0.1, 0.2, 0.4]),
        ("equal", [0.075, 0.15, 0.3, 0.6]),
        # From previous = base = 0.1: 0.1 + 0.5 * (3 * previous - 0.1).
        ("decorrelated", [0.2, 0.35, 0.575, 0.9125]),
    ],
)
def test_each_jitter_draws_its_own_delays(kind, jitter, expected, server, fake):
    server.script.extend([answer(503)] * 4)

    call(kind, make_policy(fake, jitter=jitter, max_attempts=5), "GET", server.url())

    assert fake.sleeps == pytest.approx(expected)
    assert len(server.seen) == 5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jitter", ["full", "equal", "decorrelated"])
def test_random_delays_stay_within_their_jitters_bounds(kind, jitter, server, fake):
    attempts = 8
    server.script.extend([answer(503)] * attempts)
    policy = make_policy(
        fake,
        jitter=jitter,
        max_attempts=attempts,
        base_delay=0.5,
        max_delay=6.0,
        random=random.Random(7).random,  # noqa: S311 - a seeded draw, not a secret
    )

    call(kind, policy, "GET", server.url())

    assert len(fake.sleeps) == attempts - 1
    previous = 0.5
    for attempt, delay in enumerate(fake.sleeps, start=1):
        bound = exponential_bound(attempt, 0.5, 6.0)
        if jitter == "full":
            assert 0 <= delay <= bound
        elif jitter == "equal":
            assert bound / 2 <= delay <= bound
        else:
            assert 0.5 <= delay <= min(6.0, 3 * previous)
            previous = delay
    assert max(fake.sleeps) <= 6.0


@pytest.mark.parametrize("kind", KINDS)
def test_retry_after_in_seconds_is_the_least_wait(kind, server, fake):
    server.script.append(answer(429, {"Retry-After": "2"}))

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert fake.sleeps == [2.0]
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_retry_after_as_an_http_date(kind, server, fake):
    server.script.append(
        answer(503, {"Retry-After": email.utils.formatdate(WALL + 5, usegmt=True)})
    )

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert fake.sleeps == [5.0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "value",
    [email.utils.formatdate(WALL - 60, usegmt=True), "0", "soon", "1.5", "-3"],
    ids=["past-date", "zero", "word", "fraction", "negative"],
)
def test_retry_after_in_the_past_or_malformed_leaves_the_backoff(kind, value, server, fake):
    server.script.append(answer(503, {"Retry-After": value}))

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert fake.sleeps == [0.05]


@pytest.mark.parametrize("kind", KINDS)
def test_a_retry_after_shorter_than_the_backoff_does_not_shorten_it(kind, server, fake):
    server.script.append(answer(503, {"Retry-After": "1"}))

    call(kind, make_policy(fake, base_delay=4.0, random=lambda: 0.75), "GET", server.url())

    assert fake.sleeps == [3.0]


def test_retry_after_values():
    parse = parse_retry_after
    assert parse(" 7 ", WALL) == 7.0
    assert parse("Wed, 15 Nov 2023 00:00:00 GMT", 1_700_006_400.0 - 30) == 30.0
    # "-0000" makes a naive datetime; HTTP-dates are GMT all the same.
    assert parse("Wed, 15 Nov 2023 00:00:00 -0000", 1_700_006_400.0 - 30) == 30.0
    assert parse("Wed, 15 Nov 2023 00:00:00 GMT", 1_700_006_400.0 + 30) == 0.0
    assert parse("\u00b2", WALL) is None
    assert parse("", WALL) is None
    assert parse("9" * 5000, WALL) == float("inf")


# --- the policy -------------------------------------------------------------------------------


def test_the_policys_defaults():
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.base_delay, policy.max_delay, policy.deadline) == (
        4,
        0.1,
        10.0,
        30.0,
    )
    assert (policy.jitter, policy.key_header, policy.add_keys) == ("full", "Idempotency-Key", True)
    assert isinstance(policy.budget, RetryBudgets)
    assert RetryPolicy().budget is policy.budget
    assert isinstance(policy.breaker, CircuitBreakers)
    assert RetryPolicy().breaker is policy.breaker
    breaker = policy.breaker.breaker_for("defaults.example")
    assert (breaker.failure_threshold, breaker.window, breaker.cool_down) == (10, 30.0, 10.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"base_delay": -1.0}, "base_delay"),
        ({"base_delay": 20.0, "max_delay": 10.0}, "base_delay"),
        ({"deadline": 0}, "deadline"),
        ({"jitter": "none"}, "jitter"),
        ({"key_header": ""}, "key_header"),
    ],
)
def test_policy_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**settings)


@pytest.mark.parametrize("kind", KINDS)
def test_max_attempts_of_one_never_retries(kind, server, fake):
    server.script.append(answer(503))

    assert call(kind, make_policy(fake, max_attempts=1), "GET", server.url()).status == 503
    assert len(server.seen) == 1


def test_the_default_policy_retries(server):
    server.script.append(answer(503))

    with retrying_session() as session:
        assert session.get(server.url()).status_code == 200
    server.script.append(answer(503))
    with httpx.Client(transport=RetryTransport()) as session:
        assert session.get(server.url()).status_code == 200

    assert len(server.seen) == 4
