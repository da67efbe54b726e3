"""Retry budgets (``client._budgets``), through the three clients and on their own."""

from __future__ import annotations

import logging
import threading
from collections import deque

import httpx
import pytest

from django_idempotency.client import RetryBudget, RetryBudgets, RetryTransport
from tests.client.helpers import KINDS, TRANSPORT_ERRORS, answer, call, make_policy, reset


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_budget_fails_fast_with_the_response(kind, server, fake):
    server.script.extend([answer(503), answer(503)])
    budgets = RetryBudgets(min_retries_per_second=0, percent_can_retry=0.0, clock=fake.clock)

    result = call(kind, make_policy(fake, budget=budgets), "GET", server.url())

    assert result.status == 503
    assert len(server.seen) == 1
    assert fake.sleeps == []


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_budget_fails_fast_with_the_error(kind, server, fake):
    server.script.extend([reset, reset])
    budgets = RetryBudgets(min_retries_per_second=0, percent_can_retry=0.0, clock=fake.clock)

    with pytest.raises(TRANSPORT_ERRORS[kind]):
        call(kind, make_policy(fake, budget=budgets), "GET", server.url())

    assert len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_reserve_allows_exactly_its_retries_then_refills(kind, server, fake):
    # 0.2 retries a second over 10 seconds: a reserve of exactly 2 retries.
    budgets = RetryBudgets(
        ttl=10.0, min_retries_per_second=0.2, percent_can_retry=0.0, clock=fake.clock
    )
    policy = make_policy(fake, budget=budgets, max_attempts=10, deadline=1000.0)
    server.script.extend([answer(503)] * 20)

    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 3
    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 4

    fake.now += 10.0
    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 7


@pytest.mark.parametrize("kind", KINDS)
def test_first_attempts_earn_retries_in_proportion(kind, server, fake):
    budgets = RetryBudgets(min_retries_per_second=0, percent_can_retry=0.25, clock=fake.clock)
    policy = make_policy(fake, budget=budgets, max_attempts=10)
    for _ in range(7):
        assert call(kind, policy, "GET", server.url()).status == 200

    # Seven first attempts, and the eighth: 8 x 0.25 = 2 retries.
    server.script.extend([answer(503)] * 5)
    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 7 + 3


@pytest.mark.parametrize("kind", KINDS)
def test_no_budget_means_no_limit_but_the_attempts(kind, server, fake):
    server.script.extend([answer(503)] * 5)

    call(kind, make_policy(fake, budget=None, max_attempts=6), "GET", server.url())

    assert len(server.seen) == 6


def test_hosts_have_separate_budgets(fake):
    budgets = RetryBudgets(min_retries_per_second=0.1, clock=fake.clock)

    assert budgets.budget_for("a.test") is budgets.budget_for("a.test")
    assert budgets.budget_for("a.test").try_withdraw()
    assert not budgets.budget_for("a.test").try_withdraw()
    assert budgets.budget_for("b.test").try_withdraw()
    assert budgets.budget_for("a.test:8443").try_withdraw()


def test_a_url_without_a_port_is_budgeted_and_logged_by_host_name(fake, caplog):
    answers = deque([httpx.Response(503), httpx.Response(200)])
    transport = RetryTransport(
        httpx.MockTransport(lambda request: answers.popleft()), make_policy(fake)
    )
    caplog.set_level(logging.INFO, logger="django_idempotency.client")

    with httpx.Client(transport=transport) as session:
        session.get("https://example.test/path")

    assert [r.idempotency_client_host for r in caplog.records] == ["example.test"]


def test_a_budget_counts_exactly(fake):
    budget = RetryBudget(min_retries_per_second=0, percent_can_retry=0.1, clock=fake.clock)
    for _ in range(9):
        budget.deposit()
    assert budget.balance == pytest.approx(0.9)
    assert not budget.try_withdraw()

    budget.deposit()
    assert budget.balance == 1.0
    assert budget.try_withdraw()
    assert budget.balance == 0.0
    assert not budget.try_withdraw()


def test_deposits_expire_after_the_ttl(fake):
    budget = RetryBudget(
        ttl=10.0, min_retries_per_second=0, percent_can_retry=1.0, clock=fake.clock
    )
    budget.deposit()
    fake.now += 5.0
    budget.deposit()
    assert budget.balance == 2.0

    fake.now += 5.0
    assert budget.balance == 1.0
    fake.now += 4.999
    assert budget.balance == 1.0
    fake.now += 0.001
    assert budget.balance == 0.0
    assert not budget.try_withdraw()


def test_withdrawals_expire_so_the_reserve_refills(fake):
    budget = RetryBudget(
        ttl=2.0, min_retries_per_second=1.0, percent_can_retry=0.0, clock=fake.clock
    )
    assert budget.balance == 2.0
    assert budget.try_withdraw()
    fake.now += 1.0
    assert budget.try_withdraw()
    assert not budget.try_withdraw()

    fake.now += 1.0
    assert budget.balance == 1.0
    assert budget.try_withdraw()
    assert not budget.try_withdraw()


def test_a_budget_is_safe_across_threads():
    budget = RetryBudget(ttl=60.0, min_retries_per_second=0, percent_can_retry=0.5)
    granted = []

    def work():
        for _ in range(1000):
            budget.deposit()
            granted.append(budget.try_withdraw())

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # 8000 deposits of half a token: every one of the 4000 tokens is either spent or still there,
    # however the threads interleave.
    assert granted.count(True) + budget.balance == 4000
    assert 0 <= budget.balance < 8


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ttl": 0}, "ttl must be positive"),
        ({"min_retries_per_second": -1}, "must not be negative"),
        ({"percent_can_retry": -0.1}, "must not be negative"),
    ],
)
def test_budget_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        RetryBudget(**settings)
    with pytest.raises(ValueError, match=message):
        RetryBudgets(**settings)
