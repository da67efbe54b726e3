"""Lease mode, black-box: a worker that outlives its lease, alive but slow, books the charge once.

The example's ``POST /api/charges/`` charges a card at a provider outside the database, in lease
mode. A client whose request takes too long sends it again with the same key once the lease has
run out. Whatever the first worker does when it wakes up, the books must show one charge, and
both clients must be told of the same payment (or the slow one a 409).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.blackbox.harness import wait_for

pytestmark = pytest.mark.postgresql

CHARGES = "/api/charges/"
CHARGE = {"amount": 2500, "currency": "eur", "description": "a slow worker"}
KEY = "slow-worker-charge"
# The provider's delay, before or after it takes the money, is longer than the lease.
SLOW = "1.5"
MOMENTS = {
    "slow before the provider charges": {"EXAMPLE_PROVIDER_LATENCY": SLOW},
    "slow after the provider charged": {
        "EXAMPLE_PROVIDER_LATENCY": "0.05",
        "EXAMPLE_PROVIDER_DELAY_AFTER_CHARGE": SLOW,
    },
}
ONE_OF_EACH = {
    "provider charges": 1,
    "payments": 1,
    "ledger entries": 1,
    "outbox messages": 1,
    "stored keys": 1,
}


def booked_once(database, answers):
    """Assert one charge in the books, and that every client was told of it (or got a 409)."""
    effects = database.effects()
    told = {name: (answer.status, answer.field("id")) for name, answer in answers.items()}
    assert {name: effects[name] for name in ONE_OF_EACH} == ONE_OF_EACH, (
        f"effects: {effects}; clients told (status, payment id): {told}"
    )
    (payment,) = database.payment_ids()
    assert all(
        (status, payment_id) in {(201, payment), (409, None)}
        for status, payment_id in told.values()
    ), f"clients told (status, payment id): {told}; the payment booked: {payment}"


def claimed(database):
    return database.count("django_idempotency_idempotencykey", "key = %s", (KEY,))


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_frozen_worker_past_its_lease_books_the_charge_once(serve, database, moment):
    # SIGSTOP stands for anything that stops a live worker longer than its lease (a GC pause, a
    # starved VM, a provider that hangs), including a lease that is renewed while it works.
    lease = 2.0
    server = serve(EXAMPLE_LEASE_TIMEOUT=str(lease), **MOMENTS[moment])
    slow_worker, other_worker = server.workers()
    # With the other worker frozen, the first request can only go to slow_worker.
    server.freeze(other_worker)
    with ThreadPoolExecutor(1) as pool:
        try:
            slow = pool.submit(server.post_json, CHARGES, CHARGE, key=KEY, timeout=60)
            if moment == "slow before the provider charges":
                wait_for(lambda: claimed(database), timeout=10, what="the key to be claimed")
            else:
                wait_for(
                    lambda: database.count("payments_providercharge"),
                    timeout=10,
                    what="the provider to charge",
                )
            server.freeze(slow_worker)
            frozen = database.effects()
            server.thaw(other_worker)
            wait_for(
                lambda: database.execute(
                    "SELECT locked_until < now() FROM django_idempotency_idempotencykey"
                )[0][0],
                timeout=lease + 10,
                what="the frozen worker's lease to run out",
            )
            # The client, having waited long enough, sends the request again.
            retry = server.post_json(CHARGES, CHARGE, key=KEY, timeout=30)
        finally:
            server.thaw(slow_worker)
            server.thaw(other_worker)
        first = slow.result(timeout=60)

    charged_before_freezing = 0 if moment == "slow before the provider charges" else 1
    assert frozen["provider charges"] == charged_before_freezing, frozen
    assert frozen["payments"] == 0, frozen
    assert retry.status == 201, str(retry)
    booked_once(database, {"slow request": first, "retry": retry})


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_provider_slower_than_the_lease_books_the_charge_once(serve, database, moment):
    # No signal: the worker is alive and merely waits for the provider, past its lease.
    lease = 1.0
    knobs = {name: str(float(value) * 2) for name, value in MOMENTS[moment].items()}
    server = serve(EXAMPLE_LEASE_TIMEOUT=str(lease), **knobs)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(server.post_json, CHARGES, CHARGE, key=KEY, timeout=60)
        wait_for(lambda: claimed(database), timeout=10, what="the key to be claimed")
        time.sleep(lease + 0.5)
        retry = server.post_json(CHARGES, CHARGE, key=KEY, timeout=30)
        first = slow.result(timeout=60)

    assert first.status == 201, str(first)
    booked_once(database, {"slow request": first, "retry": retry})
