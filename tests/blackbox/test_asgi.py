"""The guarantees under ASGI servers, black-box: uvicorn, and gunicorn with uvicorn's workers.

The example project's ASGI application serves three views that take a payment in atomic mode: the
DRF view (synchronous, run in a thread by Django's ASGI handler), a plain ``async def`` view with
``@idempotent``, and an ``async def`` Django Ninja operation; and an ``async def`` view that
charges a card in lease mode. Whatever the server does to a request (runs many at once, sees its
client hang up, loses its worker, lets it await past its lease), a key gets one effect, and its
retry an answer in a bounded time. Effects are counted in the database.

The module's tests share one server of each kind (starting one takes longer than most tests).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.blackbox.harness import ASGI_SERVERS, PROBLEM, wait_for

pytestmark = pytest.mark.postgresql

# Seconds. Every view waits LATENCY for the provider: long enough for a test to act while it
# runs. The lease-mode view then awaits DELAY_AFTER_CHARGE more once the money is taken, six
# times its LEASE.
LEASE, LATENCY, DELAY_AFTER_CHARGE = 1.0, 1.0, 6.0
KNOBS = {
    "EXAMPLE_LEASE_TIMEOUT": str(LEASE),
    "EXAMPLE_PROVIDER_LATENCY": str(LATENCY),
    "EXAMPLE_PROVIDER_DELAY_AFTER_CHARGE": str(DELAY_AFTER_CHARGE),
}
VIEWS = {
    "drf": "/api/payments/",
    "async-decorator": "/async/payments/",
    "async-ninja": "/ninja/async-payments/",
}
CHARGES = "/async/charges/"
PAYMENT_BODY = json.dumps({"amount": 1000, "currency": "eur", "description": "a book"}).encode()
ONE_PAYMENT = {"provider charges": 0, "payments": 1, "ledger entries": 1, "stored keys": 1}
# How long a client keeps retrying a key that is in progress before the test gives up on it.
RETRY_BOUND = 20.0

servers = pytest.mark.parametrize("server_name", list(ASGI_SERVERS))
views = pytest.mark.parametrize("view", list(VIEWS))


@pytest.fixture
def server(share_asgi, server_name):
    return share_asgi(server_name, **KNOBS)


def effects(database, names=ONE_PAYMENT):
    counted = database.effects()
    return {name: counted[name] for name in names}


def holding(database) -> int:
    """Transactions on the served database that hold a key: by its advisory lock (atomic mode
    on PostgreSQL, before the view writes anything), or a row they have written."""
    return database.count(
        "pg_locks",
        "locktype = 'advisory' AND granted AND pid <> pg_backend_pid() "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    ) + database.count(
        "pg_stat_activity",
        "datname = current_database() AND backend_type = 'client backend' "
        "AND backend_xid IS NOT NULL AND pid <> pg_backend_pid()",
    )


def settled(database) -> bool:
    """No transaction is open on the served database: no request is still at work."""
    return not database.count(
        "pg_stat_activity",
        "datname = current_database() AND backend_type = 'client backend' "
        "AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
    )


def until_answered(server, path, key):
    """Send the request until it is not ``409 in progress``, within RETRY_BOUND seconds; return
    the answer and how many 409s came before it."""
    deadline = time.monotonic() + RETRY_BOUND
    conflicts = 0
    while True:
        answer = server.send("POST", path, PAYMENT_BODY, key=key)
        if answer.status != 409:
            return answer, conflicts
        assert (answer.content_type, answer.field("code")) == (PROBLEM, "idempotency.in_progress")
        assert answer.headers["Retry-After"], str(answer)
        conflicts += 1
        assert time.monotonic() < deadline, f"still in progress after {RETRY_BOUND} s: {answer}"
        time.sleep(0.1)


@servers
@views
def test_concurrent_duplicates_make_one_payment_and_get_its_answer(server, database, view):
    # Sent at the same instant: one runs, each other one waits for it and replays its answer
    # (or, waiting longer than WAIT_TIMEOUT, gets a 409 and retries until it replays).
    count = 32
    path, key = VIEWS[view], f"burst-{view}"
    together = threading.Barrier(count)

    def send(_):
        together.wait()
        return until_answered(server, path, key)

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(send, range(count)))
    answers = [answer for answer, _ in results]
    wait_for(lambda: settled(database), timeout=10, what="every request to finish")

    assert sorted(answer.status for answer in answers) == [201] * count, [
        str(answer) for answer in answers if answer.status != 201
    ]
    assert sorted(answer.headers["Idempotency-Status"] for answer in answers) == (
        ["replayed"] * (count - 1) + ["stored"]
    )
    assert effects(database) == ONE_PAYMENT
    assert len({answer.body for answer in answers}) == 1
    assert {answer.field("id") for answer in answers} == database.payment_ids()


@servers
@views
def test_a_client_that_hangs_up_mid_request_neither_burns_nor_blocks_its_key(
    server, database, view
):
    # The server sees the disconnect while the view runs (Django's ASGI handler cancels the
    # request's task). Whether the view finished or was rolled back, the retry with the same key
    # gets the one payment: replayed, or made now, once.
    path, key = VIEWS[view], f"hang-up-{view}"
    pending = server.open_request("POST", path, PAYMENT_BODY, key=key)
    wait_for(lambda: holding(database), timeout=10, what="the view to run, its key held")
    pending.hang_up()

    retry, _ = until_answered(server, path, key)
    wait_for(lambda: settled(database), timeout=10, what="the hung-up request to finish")
    again = server.send("POST", path, PAYMENT_BODY, key=key)

    assert retry.status == 201, str(retry)
    assert retry.headers["Idempotency-Status"] in {"stored", "replayed"}
    assert (again.status, again.headers["Idempotency-Status"]) == (201, "replayed"), str(again)
    assert again.body == retry.body
    assert effects(database) == ONE_PAYMENT
    assert {retry.field("id")} == database.payment_ids()


@servers
@views
def test_a_worker_killed_mid_request_is_recovered_by_the_retry(server, database, view):
    # SIGKILL, as the OOM killer or a deploy's kill -9 does: the transaction that holds the key
    # dies with its connection, the key with it, and the retry runs the view once.
    path, key = VIEWS[view], f"killed-{view}"
    pending = server.open_request("POST", path, PAYMENT_BODY, key=key)
    wait_for(lambda: holding(database), timeout=10, what="the view to run, its key held")
    server.kill(server.worker_serving(pending))
    with pytest.raises(ConnectionResetError):  # the server hung up on it: no answer
        pending.answer()
    before_the_retry = effects(database)

    retry, _ = until_answered(server, path, key)
    again = server.send("POST", path, PAYMENT_BODY, key=key)

    assert before_the_retry == dict.fromkeys(ONE_PAYMENT, 0)
    assert (retry.status, retry.headers["Idempotency-Status"]) == (201, "stored"), str(retry)
    assert (again.status, again.headers["Idempotency-Status"]) == (201, "replayed"), str(again)
    assert effects(database) == ONE_PAYMENT
    assert {retry.field("id")} == database.payment_ids()


@servers
def test_a_client_that_hangs_up_on_a_lease_mode_view_after_the_charge_is_charged_once(
    server, database
):
    # The disconnect cancels the async view while it awaits, once the provider took the money.
    # The key stays claimed until its lease, no longer renewed, runs out; then the retry takes it
    # over, and the view's recovery hook finds the charge instead of charging again.
    key = "hang-up-lease"
    pending = server.open_request("POST", CHARGES, PAYMENT_BODY, key=key)
    wait_for(
        lambda: database.count("payments_providercharge"), timeout=10, what="the provider to charge"
    )
    pending.hang_up()

    retry, _ = until_answered(server, CHARGES, key)
    wait_for(lambda: settled(database), timeout=10, what="the hung-up request to finish")
    again = server.send("POST", CHARGES, PAYMENT_BODY, key=key)

    assert (retry.status, retry.headers["Idempotency-Status"]) == (201, "stored"), str(retry)
    # Within the lease and one wait: the view's await was cut short, not waited out.
    assert retry.seconds < LEASE + DELAY_AFTER_CHARGE / 2, retry.seconds
    assert (again.status, again.headers["Idempotency-Status"]) == (201, "replayed"), str(again)
    assert effects(database) == {**ONE_PAYMENT, "provider charges": 1}
    (reference,) = database.execute("SELECT reference FROM payments_providercharge")[0]
    assert retry.field("provider_reference") == reference


def lease_of(database, key):
    """The key's row: whether its lease is still running, its lease version, its state."""
    rows = database.execute(
        "SELECT locked_until > now(), lease_version, state "
        "FROM django_idempotency_idempotencykey WHERE key = %s",
        (key,),
    )
    return rows[0] if rows else None


@servers
def test_a_lease_is_renewed_while_an_async_view_awaits_past_it(server, database):
    # Lease mode commits the key before the view runs. The view awaits the provider seven times
    # as long as the lease: were the lease not renewed meanwhile, a retry would take the key over
    # and run the view again.
    key = "lease-async"
    pending = server.open_request("POST", CHARGES, PAYMENT_BODY, key=key, timeout=30)
    claimed = wait_for(lambda: lease_of(database, key), timeout=10, what="the key to be claimed")
    time.sleep(LEASE * 1.5)
    past_the_first_lease = lease_of(database, key)
    retry = server.send("POST", CHARGES, PAYMENT_BODY, key=key)
    after_the_retry = lease_of(database, key)
    first = pending.answer()
    again = server.send("POST", CHARGES, PAYMENT_BODY, key=key)

    running = (True, claimed[1], "in_progress")
    assert {"past the first lease": past_the_first_lease, "after the retry": after_the_retry} == {
        "past the first lease": running,
        "after the retry": running,
    }
    assert (retry.status, retry.content_type, retry.field("code")) == (
        409,
        PROBLEM,
        "idempotency.in_progress",
    ), str(retry)
    assert retry.headers["Retry-After"]
    assert (first.status, first.headers["Idempotency-Status"]) == (201, "stored"), str(first)
    assert first.seconds > LATENCY + DELAY_AFTER_CHARGE > 5 * LEASE
    assert (again.status, again.headers["Idempotency-Status"]) == (201, "replayed"), str(again)
    assert again.body == first.body
    assert effects(database) == {**ONE_PAYMENT, "provider charges": 1}
    assert {first.field("id")} == database.payment_ids()
