"""Circuit breakers (``client._breaker``), through the three clients and on their own."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading

import httpx
import pytest

from django_idempotency.client import (
    AsyncRetryTransport,
    CircuitBreaker,
    CircuitBreakers,
    CircuitOpen,
)
from tests.client.helpers import (
    KINDS,
    TRANSPORT_ERRORS,
    Result,
    answer,
    call,
    drop,
    make_policy,
    reset,
    slow,
)


def breaker_policy(fake, *, failure_threshold=3, window=30.0, cool_down=5.0, **overrides):
    breakers = CircuitBreakers(
        failure_threshold=failure_threshold, window=window, cool_down=cool_down, clock=fake.clock
    )
    return make_policy(fake, **{"breaker": breakers, "max_attempts": 1, **overrides})


def open_circuit(kind, server, policy, failures=3):
    server.script.extend([answer(503)] * failures)
    for _ in range(failures):
        assert call(kind, policy, "GET", server.url()).status == 503


def fail_fast(kind, server, policy, url=None):
    """Call, expecting CircuitOpen without the server seeing the request; return the error."""
    seen = len(server.seen)
    with pytest.raises(CircuitOpen) as raised:
        call(kind, policy, "GET", url or server.url())
    assert len(server.seen) == seen
    assert isinstance(raised.value, TRANSPORT_ERRORS[kind])
    return raised.value


@pytest.mark.parametrize("kind", KINDS)
def test_the_circuit_opens_after_n_failures_in_a_row_then_fails_fast(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)

    error = fail_fast(kind, server, policy)

    assert (error.host, error.retry_in) == (server.host, 5.0)
    assert str(error) == f"circuit open for {server.host}: failing fast, next trial in 5.000 s"
    assert fake.sleeps == []  # failing fast waits for nothing: not the cool-down, nor a backoff
    breaker = policy.breaker.breaker_for(server.host)
    assert (breaker.state, breaker.opened, breaker.rejected) == ("open", 1, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_success_between_failures_keeps_the_circuit_closed(kind, server, fake):
    policy = breaker_policy(fake)
    server.script.extend([answer(500), answer(502), answer(404), answer(504), answer(503)])

    statuses = [call(kind, policy, "GET", server.url()).status for _ in range(6)]

    assert statuses == [500, 502, 404, 504, 503, 200]
    assert policy.breaker.breaker_for(server.host).state == "closed"


@pytest.mark.parametrize("kind", KINDS)
def test_failures_further_apart_than_the_window_are_forgotten(kind, server, fake):
    policy = breaker_policy(fake, window=30.0)
    server.script.extend([answer(503)] * 3)

    statuses = [call(kind, policy, "GET", server.url()).status]
    fake.now += 30.0
    statuses += [call(kind, policy, "GET", server.url()).status for _ in range(3)]

    # The first failure was 30 s old when the third came: two failures in the window, not three.
    assert statuses == [503, 503, 503, 200]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [408, 425, 429, 409, 501])
def test_statuses_that_do_not_blame_the_host_do_not_count(kind, status, server, fake):
    policy = breaker_policy(fake, failure_threshold=1)
    server.script.append(answer(status))

    assert call(kind, policy, "GET", server.url()).status == status
    assert call(kind, policy, "GET", server.url()).status == 200


@pytest.mark.parametrize("kind", KINDS)
def test_transport_errors_count(kind, server, fake):
    policy = breaker_policy(fake, failure_threshold=2)
    server.script.extend([reset, drop])
    for _ in range(2):
        with pytest.raises(TRANSPORT_ERRORS[kind]):
            call(kind, policy, "GET", server.url())

    fail_fast(kind, server, policy)


@pytest.mark.parametrize("kind", KINDS)
def test_after_the_cool_down_a_successful_trial_closes_the_circuit(kind, server, fake, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.client")
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    fake.now += 4.5
    assert fail_fast(kind, server, policy).retry_in == pytest.approx(0.5)
    fake.now += 0.5
    assert policy.breaker.breaker_for(server.host).state == "half_open"

    assert call(kind, policy, "GET", server.url()).status == 200
    assert call(kind, policy, "GET", server.url()).status == 200

    assert policy.breaker.breaker_for(server.host).state == "closed"
    changes = [
        (r.levelno, r.idempotency_client_circuit, r.getMessage())
        for r in caplog.records
        if hasattr(r, "idempotency_client_circuit")
    ]
    assert changes == [
        (logging.WARNING, "open", f"circuit open for {server.host}: failing fast for 5.000 s"),
        (
            logging.INFO,
            "half_open",
            f"circuit half-open for {server.host}: sending one trial request",
        ),
        (logging.INFO, "closed", f"circuit closed for {server.host}: the trial request succeeded"),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_trial_opens_the_circuit_again(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    fake.now += 5.0
    server.script.append(answer(503))

    assert call(kind, policy, "GET", server.url()).status == 503

    assert fail_fast(kind, server, policy).retry_in == 5.0
    assert policy.breaker.breaker_for(server.host).opened == 2


def test_half_open_lets_exactly_one_trial_through_across_threads(server, fake):
    policy = breaker_policy(fake)
    open_circuit("httpx", server, policy)
    fake.now += 5.0
    server.script.append(slow)  # the trial's answer waits until the others have failed fast
    outcomes = []
    start = threading.Barrier(8)

    def work(kind):
        start.wait()
        try:
            outcomes.append(call(kind, policy, "GET", server.url(), timeout=10.0))
        except CircuitOpen as error:
            outcomes.append(error)

    threads = [threading.Thread(target=work, args=(KINDS[i % 3],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for _ in range(500):
        if len(outcomes) == 7:
            break
        threading.Event().wait(0.01)
    server.release.set()
    for thread in threads:
        thread.join()

    errors = [o for o in outcomes if isinstance(o, CircuitOpen)]
    assert [o.status for o in outcomes if isinstance(o, Result)] == [200]
    assert [error.retry_in for error in errors] == [0.0] * 7
    assert "while a trial request runs" in str(errors[0])
    assert len(server.seen) == 4
    assert policy.breaker.breaker_for(server.host).state == "closed"


def test_async_half_open_lets_exactly_one_trial_through(server, fake):
    policy = breaker_policy(fake)
    open_circuit("async", server, policy)
    fake.now += 5.0
    server.script.append(slow)

    async def main():
        transport = AsyncRetryTransport(policy=policy)
        async with httpx.AsyncClient(transport=transport, timeout=10.0) as session:
            trial = asyncio.create_task(session.get(server.url()))
            while not server.seen[3:]:  # the trial has reached the server
                await asyncio.sleep(0.01)
            others = await asyncio.gather(
                *(session.get(server.url()) for _ in range(5)), return_exceptions=True
            )
            server.release.set()
            return (await trial).status_code, others

    status, others = asyncio.run(main())

    assert status == 200
    assert all(isinstance(error, CircuitOpen) for error in others)
    assert len(server.seen) == 4


def test_a_trial_that_says_nothing_of_the_host_leaves_the_next_request_the_trial(fake):
    breaker = CircuitBreaker("example.test", failure_threshold=1, cool_down=5.0, clock=fake.clock)
    breaker.record(breaker.admit(), "failure")
    fake.now += 5.0
    trial = breaker.admit()
    assert trial.trial
    assert not breaker.admit().allowed

    breaker.record(trial, "neither")  # cancelled, say

    assert breaker.state == "half_open"
    assert breaker.admit().trial


def test_only_the_trial_decides_once_the_circuit_is_open(fake):
    breaker = CircuitBreaker("example.test", failure_threshold=2, clock=fake.clock)
    early = breaker.admit()  # let through while the circuit was closed, answered after it opened
    breaker.record(breaker.admit(), "failure")
    breaker.record(breaker.admit(), "failure")

    breaker.record(early, "success")

    assert breaker.state == "open"


def test_a_cancelled_async_trial_frees_the_trial(server, fake):
    policy = breaker_policy(fake)
    open_circuit("async", server, policy)
    fake.now += 5.0
    server.script.append(slow)

    async def main():
        transport = AsyncRetryTransport(policy=policy)
        async with httpx.AsyncClient(transport=transport, timeout=10.0) as session:
            trial = asyncio.create_task(session.get(server.url()))
            while not server.seen[3:]:
                await asyncio.sleep(0.01)
            trial.cancel()
            with pytest.raises(asyncio.CancelledError):
                await trial
            server.release.set()
            return (await session.get(server.url())).status_code

    assert asyncio.run(main()) == 200
    assert policy.breaker.breaker_for(server.host).state == "closed"


@pytest.mark.parametrize("kind", KINDS)
def test_circuits_are_per_host(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    fail_fast(kind, server, policy)

    other = server.url().replace("127.0.0.1", "localhost")
    assert call(kind, policy, "GET", other).status == 200


@pytest.mark.parametrize("kind", KINDS)
def test_retries_stop_once_the_circuit_opens(kind, server, fake, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.client")
    policy = breaker_policy(fake, max_attempts=6)
    server.script.extend([answer(503)] * 6)

    assert call(kind, policy, "GET", server.url()).status == 503

    assert len(server.seen) == 3
    assert caplog.records[-1].idempotency_client_stop == "circuit_open"
    # One first attempt deposited 0.2 of a token and two retries spent one each; the retry the
    # circuit stopped spent nothing.
    assert policy.budget.budget_for(server.host).balance == pytest.approx(100.0 + 0.2 - 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_failed_fast_earns_no_retries(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    budget = policy.budget.budget_for(server.host)
    balance = budget.balance

    fail_fast(kind, server, policy)

    assert budget.balance == balance


@pytest.mark.parametrize("kind", KINDS)
def test_a_circuit_that_opens_during_the_wait_ends_the_retries(kind, server, fake, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.client")

    # Other requests' failures open the circuit while this one waits to retry.
    def opened_meanwhile(seconds):
        fake.sleep(seconds)
        breaker = policy.breaker.breaker_for(server.host)
        for _ in range(3):
            breaker.record(breaker.admit(), "failure")

    async def async_opened_meanwhile(seconds):
        opened_meanwhile(seconds)

    policy = breaker_policy(
        fake, max_attempts=4, sleep=opened_meanwhile, async_sleep=async_opened_meanwhile
    )
    server.script.append(answer(503))

    with pytest.raises(CircuitOpen):
        call(kind, policy, "GET", server.url())
    assert len(server.seen) == 1
    # The refused attempt is not a failure to retry, whichever library's error it is.
    attempts = [r.idempotency_client_attempt for r in caplog.records if r.msg.startswith("retry")]
    assert attempts == [1]
    assert not [r for r in caplog.records if r.msg.startswith("not retrying")]


@pytest.mark.parametrize("kind", KINDS)
def test_no_breaker_means_no_circuit(kind, server, fake):
    policy = make_policy(fake, breaker=None, max_attempts=1)
    server.script.extend([answer(503)] * 20)

    statuses = [call(kind, policy, "GET", server.url()).status for _ in range(21)]

    assert statuses == [503] * 20 + [200]


@pytest.mark.django_db  # a scrape also reads the backlog gauges from the database
def test_circuit_states_and_counts_are_metrics(server, fake):
    from prometheus_client import REGISTRY  # noqa: PLC0415 - an extra, as for users

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, {"host": server.host, **labels})

    policy = breaker_policy(fake)
    open_circuit("httpx", server, policy)
    fail_fast("httpx", server, policy)
    fail_fast("httpx", server, policy)
    # A second policy's breakers for the same host add to the counts.
    other = breaker_policy(fake)
    assert call("httpx", other, "GET", server.url()).status == 200

    circuits = "django_idempotency_client_circuits"
    assert sample(circuits, state="open") == 1
    assert sample(circuits, state="closed") == 1
    assert sample(circuits, state="half_open") == 0
    assert sample("django_idempotency_client_circuit_opened_total") == 1
    assert sample("django_idempotency_client_circuit_rejected_total") == 2
    fake.now += 5.0
    assert sample(circuits, state="half_open") == 1
    # The breakers of a policy that is gone leave the metrics with it.
    del other
    gc.collect()
    assert sample(circuits, state="closed") == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"failure_threshold": 0}, "failure_threshold must be at least 1"),
        ({"window": 0}, "window and cool_down must be positive"),
        ({"cool_down": -1.0}, "window and cool_down must be positive"),
    ],
)
def test_breaker_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        CircuitBreakers(**settings)
    with pytest.raises(ValueError, match=message):
        CircuitBreaker(**settings)
