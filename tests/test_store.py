"""Races and failures on PostgreSQL and MariaDB: real threads, each with its own connection."""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta

import pytest
from django.db import close_old_connections, connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.core.engine import Engine
from django_idempotency.core.operation import Answer, Operation, Record, fit_scope
from django_idempotency.core.outcomes import Outcome
from django_idempotency.core.rows import Claim, Conflict, NewKey, StoredResponse
from django_idempotency.core.store import key_store
from django_idempotency.keys import ScopedKey
from django_idempotency.models import IdempotencyKey
from tests.conftest import BEHIND_PGBOUNCER, ApiClient
from tests.factories import IdempotencyKeyFactory
from tests.testapp.models import LedgerEntry, Payment
from tests.testapp.views import lock_wait_bound

pytestmark = [pytest.mark.server_db, pytest.mark.django_db(transaction=True)]

# A pooler hands the next transaction another server session: a session ended between
# requests is not lost to the application (test_a_session_ended_behind_a_pooler_is_replaced).
direct_sessions = pytest.mark.skipif(
    BEHIND_PGBOUNCER, reason="behind PgBouncer, a session ended between requests is replaced"
)


def in_threads(count, work):
    """Run ``work(i)`` in ``count`` threads released together; return results in order."""
    barrier = threading.Barrier(count)
    results = [None] * count
    errors = []

    def run(index):
        try:
            barrier.wait()
            results[index] = work(index)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    return results


def start(work):
    """Run ``work()`` in one background thread; ``join()`` returns its result."""
    result = {}

    def run():
        try:
            result["value"] = work()
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join(timeout=60)
        return result["value"]

    return join


def wait_for_key_held(timeout=5.0):
    """Block until another session holds a key in its transaction: on PostgreSQL, the advisory
    lock an atomic-mode request takes, or an uncommitted key row; elsewhere, the row.

    pg_locks lists the locks of the whole server, where other test passes run at the same time:
    only this database's count.
    """
    table = IdempotencyKey._meta.db_table
    if connection.vendor == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_locks l LEFT JOIN pg_class c ON c.oid = l.relation "
            "WHERE (l.locktype = 'advisory' OR c.relname = %s AND l.mode = 'RowExclusiveLock') "
            "AND l.granted AND l.pid <> pg_backend_pid() "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        params, looks = [table], connection.cursor()
    else:  # a dirty read, on a connection of its own, sees the row before it commits
        sql, params = f"SELECT count(*) FROM {table}", []  # noqa: S608 - the model's table
        other = connection.get_new_connection(connection.get_connection_params())
        other.autocommit(True)
        looks = other.cursor()
        looks.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            looks.execute(sql, params)
            if looks.fetchone()[0]:
                return
            time.sleep(0.01)
    finally:
        looks.close()
    raise AssertionError("no request claimed a key")


def test_twenty_concurrent_duplicates_make_one_payment(alice, key):
    def post(_):
        return ApiClient(alice).send(
            "POST", "/payments/", {"amount": 1000}, key=key, headers={"X-Hold": "0.3"}
        )

    responses = in_threads(20, post)

    assert Payment.objects.count() == 1
    assert LedgerEntry.objects.count() == 1
    assert IdempotencyKey.objects.count() == 1
    statuses = [response.status_code for response in responses]
    assert all(status in (201, 409) for status in statuses), statuses
    answered = [response for response in responses if response.status_code == 201]
    assert len({response.content for response in answered}) == 1
    assert [response["Idempotency-Status"] for response in answered].count("stored") == 1
    for response in responses:
        if response.status_code == 409:
            assert response["Retry-After"]
            assert json.loads(response.content)["code"] == "idempotency.in_progress"


def test_a_duplicate_waits_for_the_first_and_replays_it(alice, key):
    first = start(
        lambda: ApiClient(alice).send(
            "POST", "/payments/", {"amount": 5}, key=key, headers={"X-Hold": "0.5"}
        )
    )
    wait_for_key_held()
    duplicate = ApiClient(alice).send("POST", "/payments/", {"amount": 5}, key=key)
    original = first()

    assert original["Idempotency-Status"] == "stored"
    assert duplicate["Idempotency-Status"] == "replayed"
    assert duplicate.content == original.content
    assert Payment.objects.count() == 1


@override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.2})
def test_a_duplicate_past_the_wait_bound_gets_409_then_the_replay(alice, key):
    first = start(
        lambda: ApiClient(alice).send(
            "POST", "/payments/", {"amount": 5}, key=key, headers={"X-Hold": "3"}
        )
    )
    wait_for_key_held()
    started = time.monotonic()
    busy = ApiClient(alice).send("POST", "/payments/", {"amount": 5}, key=key)
    waited = time.monotonic() - started
    original = first()
    after = ApiClient(alice).send("POST", "/payments/", {"amount": 5}, key=key)

    assert busy.status_code == 409
    assert busy["Retry-After"] == "1"
    assert json.loads(busy.content)["code"] == "idempotency.in_progress"
    assert waited < 2, "the duplicate waited for the first request instead of the bound"
    assert after["Idempotency-Status"] == "replayed"
    assert after.content == original.content
    assert Payment.objects.count() == 1


def test_a_different_body_waits_and_then_gets_422(alice, key):
    first = start(
        lambda: ApiClient(alice).send(
            "POST", "/payments/", {"amount": 5}, key=key, headers={"X-Hold": "0.5"}
        )
    )
    wait_for_key_held()
    changed = ApiClient(alice).send("POST", "/payments/", {"amount": 6}, key=key)
    first()

    assert changed.status_code == 422
    assert Payment.objects.count() == 1


def test_when_the_first_fails_the_waiting_duplicate_runs_instead(alice, key):
    def failing():
        client = ApiClient(alice, raise_request_exception=False)
        headers = {"X-Hold": "0.5", "X-Fail": "exception"}
        return client.send("POST", "/payments/", {"amount": 5}, key=key, headers=headers)

    first = start(failing)
    wait_for_key_held()
    # The test client reports a view's exception through a process-wide signal, so this
    # client must not raise the other thread's exception either.
    duplicate = ApiClient(alice, raise_request_exception=False).send(
        "POST", "/payments/", {"amount": 5}, key=key
    )

    assert first().status_code == 500
    assert duplicate["Idempotency-Status"] == "stored"
    assert Payment.objects.count() == 1
    assert LedgerEntry.objects.count() == 1


def test_when_the_first_fails_exactly_one_of_many_waiting_duplicates_runs(alice, key):
    # On MariaDB the waiters deadlock when the first's insert rolls back; the claim tries again.
    def failing():
        client = ApiClient(alice, raise_request_exception=False)
        headers = {"X-Hold": "1", "X-Fail": "exception"}
        return client.send("POST", "/payments/", {"amount": 5}, key=key, headers=headers)

    def duplicate(_):
        client = ApiClient(alice, raise_request_exception=False)
        return client.send("POST", "/payments/", {"amount": 5}, key=key, headers={"X-Hold": "0.2"})

    first = start(failing)
    wait_for_key_held()
    responses = in_threads(6, duplicate)

    assert first().status_code == 500
    outcomes = [r.get("Idempotency-Status", str(r.status_code)) for r in responses]
    # Each waits its turn and replays the one that ran: none is told "in progress".
    assert sorted(outcomes) == ["replayed"] * 5 + ["stored"], outcomes
    assert Payment.objects.count() == 1
    assert LedgerEntry.objects.count() == 1


def test_a_lost_database_connection_answers_503_and_keeps_nothing(alice, key, caplog):
    client = ApiClient(alice)
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        lost = client.send(
            "POST", "/payments/", {"amount": 5}, key=key, headers={"X-Fail": "disconnect"}
        )
    outcomes = [getattr(record, "idempotency_outcome", None) for record in caplog.records]
    assert "unavailable" in outcomes

    assert lost.status_code == 503
    assert lost["Retry-After"] == "1"
    assert json.loads(lost.content)["code"] == "idempotency.unavailable"
    assert (Payment.objects.count(), IdempotencyKey.objects.count()) == (0, 0)

    retry = client.send("POST", "/payments/", {"amount": 5}, key=key)
    assert retry["Idempotency-Status"] == "stored"
    assert Payment.objects.count() == 1


def end_this_threads_session():
    """End this thread's database session from another one, as a failover would while idle."""
    connection.ensure_connection()
    # Behind a pooler, from the server's own side: through it, the two could share a session.
    server = connections["direct"] if BEHIND_PGBOUNCER else connection
    other = server.get_new_connection(server.get_connection_params())
    try:
        cursor = other.cursor()
        if connection.vendor == "postgresql":
            # Asked of the server: behind a pooler, the driver knows only the pooler's.
            with connection.cursor() as own:
                own.execute("SELECT pg_backend_pid()")
                (pid,) = own.fetchone()
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            assert cursor.fetchone() == (True,)
        else:
            cursor.execute(f"KILL {int(connection.connection.thread_id())}")
        other.commit()
    finally:
        other.close()
    time.sleep(0.1)


@direct_sessions
def test_a_connection_killed_between_requests_answers_503_not_500(client_alice, key):
    # The next request's first query (DRF authentication, before the engine) finds it dead.
    end_this_threads_session()

    lost = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)

    assert lost.status_code == 503
    assert json.loads(lost.content)["code"] == "idempotency.unavailable"
    # At the end of a request a server drops a connection that failed (the test client
    # leaves that to the test); the retry then reconnects.
    close_old_connections()
    retry = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert retry["Idempotency-Status"] == "stored"


@pytest.mark.pgbouncer
def test_a_session_ended_behind_a_pooler_is_replaced(client_alice, key):
    end_this_threads_session()

    answer = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)

    assert (answer.status_code, answer["Idempotency-Status"]) == (201, "stored")
    assert Payment.objects.count() == 1


def leave_behind(state):
    """Leave the one key row as a retry finds it and takes it over: ``expired``, ``failed``, or
    ``lease ran out`` (its lease-mode request died)."""
    past = timezone.now() - timedelta(seconds=1)
    changes = {
        "expired": {"expires_at": past},
        "failed": {"state": IdempotencyKey.State.FAILED},
        "lease ran out": {"state": IdempotencyKey.State.IN_PROGRESS, "locked_until": past},
    }[state]
    assert IdempotencyKey.objects.update(**changes) == 1


# The claim bounds its own wait on a duplicate's row (PostgreSQL's lock_timeout, MariaDB's
# innodb_lock_wait_timeout); the view waits on its own row locks as long as it would without the
# library, whichever way the key was claimed.
@pytest.mark.parametrize("atomic_requests", [False, True], ids=["", "ATOMIC_REQUESTS"])
@pytest.mark.parametrize("found", ["nothing", "expired", "failed"])
def test_the_view_runs_under_the_sessions_own_lock_wait(
    client_alice, key, monkeypatch, found, atomic_requests
):
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", atomic_requests)
    session = lock_wait_bound()
    if found != "nothing":
        first = client_alice.send("POST", "/lock-wait/", {}, key=key)
        assert json.loads(first.content)["lock_wait"] == session
        leave_behind(found)

    response = client_alice.send("POST", "/lock-wait/", {}, key=key)

    assert response["Idempotency-Status"] == "stored"
    assert json.loads(response.content)["lock_wait"] == session
    assert IdempotencyKey.objects.get().lease_version == (1 if found == "nothing" else 2)


@pytest.mark.parametrize(
    ("amount", "outcome"),
    [(5, signals.key_replayed), (6, signals.payload_mismatch)],
    ids=["replayed", "mismatch"],
)
def test_a_duplicate_that_waited_leaves_no_bound_on_the_rest_of_its_request(
    alice, key, monkeypatch, amount, outcome
):
    # Under ATOMIC_REQUESTS the request's transaction goes on after the engine answered: its
    # signal receivers (and whatever else the request does) run in it.
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    session, seen = lock_wait_bound(), []

    def receiver(**kwargs):
        seen.append(lock_wait_bound())

    outcome.connect(receiver, weak=False)
    try:
        first = start(
            lambda: ApiClient(alice).send(
                "POST", "/payments/", {"amount": 5}, key=key, headers={"X-Hold": "0.5"}
            )
        )
        wait_for_key_held()
        duplicate = ApiClient(alice).send("POST", "/payments/", {"amount": amount}, key=key)
        first()
    finally:
        outcome.disconnect(receiver)

    assert duplicate.status_code == (201 if amount == 5 else 422)
    assert seen == [session]


# Each row a claim can find where it inserts, and what acquire() makes of it.
ANOTHER_REQUESTS = {"fingerprint": "1" * 64}
FOUND = {
    "completed": ({"completed": True}, StoredResponse),
    "another request's": ({"completed": True, **ANOTHER_REQUESTS}, Conflict),
    "leased": ({"leased": True}, Conflict),
    "expired": ({"completed": True, "expired": True}, Claim),
    "failed": ({"failed": True}, Claim),
    "lease ran out": ({"lease_expired": True}, Claim),
    "another request's, lease ran out": ({"lease_expired": True, **ANOTHER_REQUESTS}, Conflict),
}


@pytest.mark.parametrize("found", FOUND)
@pytest.mark.parametrize("asked", ["acquire", "claim"])
def test_no_claim_leaves_its_bound_on_the_transaction(found, asked):
    traits, acquired = FOUND[found]
    row = IdempotencyKeyFactory(**traits)
    now = timezone.now()
    new = NewKey(
        scope=row.scope, key=row.key, method="POST", route=row.route, fingerprint="0" * 64,
        now=now, expires_at=now + timedelta(hours=1), wait_timeout=3,
    )  # fmt: skip
    store, session = key_store(IdempotencyKey, "default"), lock_wait_bound()
    with transaction.atomic():
        answer = getattr(store, asked)(new)
        bound = lock_wait_bound()

    if asked == "acquire":
        assert isinstance(answer, acquired)
    else:
        assert isinstance(answer, Claim) is (acquired is Claim)
    assert bound == session


@override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.2})
@pytest.mark.parametrize("found", ["nothing", "expired"])
def test_a_view_waits_for_a_row_lock_longer_than_the_claims_bound(client_alice, key, found):
    payment = Payment.objects.create(amount=1)
    if found != "nothing":
        client_alice.send("POST", "/lock-wait/", {}, key=key)
        leave_behind(found)
    locked = threading.Event()

    def hold_the_row():
        with transaction.atomic():
            Payment.objects.select_for_update().get(pk=payment.pk)
            locked.set()
            # Past the claim's bound: 200 ms on PostgreSQL, a whole second on MariaDB.
            time.sleep(1.5)

    holder = start(hold_the_row)
    assert locked.wait(timeout=10)
    response = client_alice.send(
        "POST", "/lock-wait/", {}, key=key, headers={"X-Lock-Payment": str(payment.pk)}
    )
    holder()

    assert response.status_code == 201, response.content
    assert response["Idempotency-Status"] == "stored"


def test_round_trips_of_a_fresh_request_and_a_replay(client_alice, key):
    def statements(captured):
        sql = [query["sql"] for query in captured]
        return [text for text in sql if text not in ("BEGIN", "COMMIT")], sql.count("COMMIT")

    with CaptureQueriesContext(connection) as bare:
        client_alice.send("POST", "/optional/", {"amount": 1})
    with CaptureQueriesContext(connection) as fresh:
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    with CaptureQueriesContext(connection) as replay:
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

    bare_statements, _ = statements(bare)
    fresh_statements, fresh_commits = statements(fresh)
    replay_statements, replay_commits = statements(replay)
    if connection.vendor == "postgresql":
        # In one transaction: the key's lock tried with the read of its row, then the completed
        # row. A replay is that read alone, in a transaction that writes nothing.
        assert len(fresh_statements) == len(bare_statements) + 2, fresh_statements
        assert (fresh_commits, replay_commits) == (1, 1)
    else:
        # The read that finds no completed request, then the claim (its wait bound included)
        # and the completion, in one transaction. A replay is that read, in no transaction.
        assert len(fresh_statements) == len(bare_statements) + 3, fresh_statements
        assert (fresh_commits, replay_commits) == (1, 0)
    # Authentication, then one read of the key's row: nothing is written, and no row is locked
    # (the replay's count waits in memory, see counting.py).
    assert len(replay_statements) == 1 + 1, replay_statements


@pytest.mark.postgresql
def test_a_fresh_request_on_postgresql_writes_its_key_once_and_sets_no_bound(client_alice, key):
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    with CaptureQueriesContext(connection) as fresh:
        response = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

    assert response["Idempotency-Status"] == "stored"
    on_keys = [query["sql"] for query in fresh if table in query["sql"]]
    writes = [sql for sql in on_keys if not sql.startswith("SELECT")]
    # One row version: the completed row, inserted in the view's transaction.
    assert len(writes) == 1, on_keys
    assert writes[0].startswith(f"INSERT INTO {table}")
    assert not any("lock_timeout" in sql for sql in on_keys), on_keys
    assert IdempotencyKey.objects.get().state == "succeeded"


@pytest.mark.postgresql
def test_a_replay_writes_nothing_to_the_database():
    store, now = key_store(IdempotencyKey, "default"), timezone.now()
    new = NewKey(
        scope="s", key="k", method="POST", route="r/", fingerprint="f" * 64,
        now=now, expires_at=now + timedelta(hours=1), wait_timeout=1,
    )  # fmt: skip
    with transaction.atomic():
        claim = store.acquire(new)
        assert isinstance(claim, Claim)
        store.complete(claim, status=201, headers=[], body=b"{}", now=now)
    with transaction.atomic(), connection.cursor() as cursor:
        assert isinstance(store.lookup(new), StoredResponse)
        assert isinstance(store.reserve(new), StoredResponse)
        # A transaction that wrote nothing, not even a row lock, has no transaction id: its
        # commit has nothing to flush to the disk. (A claim that finds the key taken may have
        # one: the id's sequence is drawn before the conflict is found, and every 32nd draw is
        # logged.)
        cursor.execute("SELECT pg_current_xact_id_if_assigned()")
        assert cursor.fetchone() == (None,)


@direct_sessions
def test_a_dead_connection_found_by_a_plain_views_scope_answers_503(alice, key):
    # Django's session authentication loads request.user lazily: for a plain view the scope
    # function makes the request's first query.
    client = ApiClient()
    client.force_login(alice)
    end_this_threads_session()

    lost = client.send("POST", "/plain/", {"amount": 5}, key=key)

    assert lost.status_code == 503
    assert json.loads(lost.content)["code"] == "idempotency.unavailable"
    close_old_connections()


# On MariaDB, Django's ATOMIC_REQUESTS fails first: beginning the request's transaction already
# talks to the server, before any view or engine runs.
@direct_sessions
@pytest.mark.postgresql
def test_a_dead_connection_under_atomic_requests_answers_503(alice, key, monkeypatch):
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    end_this_threads_session()
    lost = ApiClient(alice).send("POST", "/payments/", {"amount": 5}, key=key)
    assert lost.status_code == 503
    close_old_connections()


def test_the_503_promises_nothing_when_the_view_ran_unprotected(alice):
    # No key on an optional-key view: the view ran on its own, its writes may be kept.
    lost = ApiClient(alice).send(
        "POST", "/optional/", {"amount": 5}, headers={"X-Fail": "disconnect"}
    )
    assert lost.status_code == 503
    assert "nothing was kept" not in json.loads(lost.content)["detail"]
    close_old_connections()


class _DriverError(Exception):
    def __init__(self, **codes):
        super().__init__("canceling statement due to lock timeout")
        self.__dict__.update(codes)


@pytest.mark.parametrize(
    ("cause", "expected"),
    [
        (_DriverError(sqlstate="55P03"), True),  # psycopg 3
        (_DriverError(pgcode="55P03"), True),  # psycopg2
        (_DriverError(sqlstate="40P01"), False),  # a deadlock is not a lock timeout
        (_DriverError(), False),  # SQLite's "database is locked"
    ],
)
def test_a_lock_timeout_is_recognised_from_either_postgresql_driver(cause, expected):
    # The claim and the purge share this detector: with psycopg2 the purge used to re-raise
    # instead of skipping the locked rows.
    from django.db import OperationalError  # noqa: PLC0415

    from django_idempotency.core.databases import is_lock_timeout  # noqa: PLC0415

    error = OperationalError(str(cause))
    error.__cause__ = cause
    assert is_lock_timeout(error) is expected


class Payer(Operation):
    """An atomic-mode operation that makes a payment, and meanwhile lets ``meanwhile()`` run."""

    lease_in_transaction = "not in a transaction"

    def __init__(self, key, *, mode="atomic", meanwhile=None):
        self.key = ScopedKey(key, fit_scope("tests:payer"))
        self.method, self.route, self.mode, self.fingerprint = "TEST", "payer", mode, "p" * 64
        self.ttl, self.lease_timeout = timedelta(hours=1), timedelta(seconds=30)
        self.wait_timeout, self.meanwhile = 1.0, meanwhile

    def run(self, attempt):
        payment = Payment.objects.create(amount=1)
        if self.meanwhile is not None:
            self.meanwhile()
        return str(payment.pk)

    def keeps(self, result):
        return True

    def encode(self, result):
        return Record(201, [], result.encode())

    def decode(self, stored):
        return stored.body.decode()


@pytest.mark.postgresql
def test_a_run_whose_key_another_stored_meanwhile_keeps_nothing_and_answers_as_it(key):
    # On PostgreSQL an atomic-mode run holds its key by an advisory lock and writes the key's row
    # only when it completes. A run that holds the key otherwise (here a lease-mode run, which
    # commits a row first; or one that committed between the first's read and its lock) and
    # stores it first wins: the unique index decides, and the loser's writes roll back.
    other = {}

    def store_it_first():
        other["answer"] = start(lambda: Engine().run(Payer(key, mode="lease")))()

    answer = Engine().run(Payer(key, meanwhile=store_it_first))

    assert other["answer"].outcome == Outcome.STORED
    assert answer == Answer(Outcome.REPLAYED, other["answer"].result, 2)
    assert list(Payment.objects.values_list("pk", flat=True)) == [int(answer.result)]
    assert IdempotencyKey.objects.get().state == "succeeded"
