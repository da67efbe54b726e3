from __future__ import annotations

import sqlite3
import threading
import time

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from django_idempotency.core.transactions import write_transaction
from django_idempotency.models import InboxEvent

ALIAS = "sqlite_file"
# Long enough that failing "at once" cannot be mistaken for having waited it out.
BUSY_TIMEOUT = 5.0
HELD = 0.3  # how long the other connection keeps the write lock


@pytest.fixture
def sqlite_file(tmp_path, django_db_blocker):
    """Open a SQLite file of the test's own, with the inbox's table, under ALIAS.

    Each thread gets a connection of its own to it, as in a server. Call with the transaction
    mode to use.
    """
    path = tmp_path / "db.sqlite3"

    def open_file(mode: str | None = None) -> str:
        options = {"timeout": BUSY_TIMEOUT, **({"transaction_mode": mode} if mode else {})}
        settings = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path), "OPTIONS": options}
        databases = connections.configure_settings({**connections.settings, ALIAS: settings})
        connections.settings[ALIAS] = databases[ALIAS]
        with connections[ALIAS].schema_editor() as editor:
            editor.create_model(InboxEvent)
        return str(path)

    with django_db_blocker.unblock():
        yield open_file
        connections[ALIAS].close()
        del connections[ALIAS]
        del connections.settings[ALIAS]


def write_lock(path: str) -> sqlite3.Connection:
    """Take the file's write lock on another connection, as another worker's writer holds it."""
    holder = sqlite3.connect(path, isolation_level=None, timeout=0)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def read_then_write(atomic) -> None:
    """What the inbox's claim does: read the event, then write it."""
    with atomic():
        events = InboxEvent.objects.using(ALIAS)
        events.filter(pk=1).first()
        events.filter(pk=1).update(attempts=1)


def in_thread(work) -> dict:
    """Start ``work()`` on a thread (and database connection) of its own; return its outcome."""
    outcome: dict = {}

    def run() -> None:
        started = time.monotonic()
        try:
            work()
        except OperationalError as error:
            outcome["error"] = str(error)
        finally:
            outcome["seconds"] = time.monotonic() - started
            connections[ALIAS].close()

    outcome["thread"] = thread = threading.Thread(target=run)
    thread.start()
    return outcome


def wait_on(outcome: dict) -> dict:
    outcome.pop("thread").join(timeout=2 * BUSY_TIMEOUT)
    return outcome


def locked_when_it_starts(path: str) -> bool:
    try:
        write_lock(path).close()
    except sqlite3.OperationalError:
        return True
    return False


@pytest.mark.sqlite
def test_a_deferred_transaction_that_read_fails_at_once_while_another_writes(sqlite_file):
    holder = write_lock(sqlite_file())
    try:
        outcome = wait_on(in_thread(lambda: read_then_write(lambda: transaction.atomic(ALIAS))))
    finally:
        holder.close()

    assert outcome["error"] == "database is locked"
    assert outcome["seconds"] < BUSY_TIMEOUT / 2


@pytest.mark.sqlite
def test_a_write_transaction_waits_for_the_write_lock_and_then_succeeds(sqlite_file):
    holder = write_lock(sqlite_file())
    outcome = in_thread(lambda: read_then_write(lambda: write_transaction(InboxEvent, ALIAS)))
    time.sleep(HELD)
    waiting = outcome["thread"].is_alive()
    holder.execute("COMMIT")
    holder.close()

    assert waiting
    assert "error" not in wait_on(outcome)
    assert HELD <= outcome["seconds"] < BUSY_TIMEOUT


@pytest.mark.sqlite
def test_a_write_transaction_holds_the_write_lock_from_its_start(sqlite_file):
    path = sqlite_file()

    with write_transaction(InboxEvent, ALIAS):
        locked = locked_when_it_starts(path)

    assert locked
    assert not locked_when_it_starts(path)


@pytest.mark.sqlite
def test_inside_a_transaction_that_has_not_read_it_takes_the_write_lock(sqlite_file):
    path = sqlite_file()

    with transaction.atomic(ALIAS), write_transaction(InboxEvent, ALIAS):
        locked = locked_when_it_starts(path)

    assert locked


@pytest.mark.sqlite
@pytest.mark.parametrize("mode", ["IMMEDIATE", "exclusive"])
def test_when_transactions_begin_as_writers_nothing_more_runs(sqlite_file, mode):
    path = sqlite_file(mode)

    with CaptureQueriesContext(connections[ALIAS]) as queries, write_transaction(InboxEvent, ALIAS):
        locked = locked_when_it_starts(path)

    assert locked
    assert [query["sql"] for query in queries] == [f"BEGIN {mode.upper()}", "COMMIT"]


@pytest.mark.django_db
def test_elsewhere_it_is_a_plain_atomic_block():
    with CaptureQueriesContext(connection) as queries, write_transaction(InboxEvent, "default"):
        assert connection.in_atomic_block

    # The test's own transaction is open: atomic makes a savepoint, everywhere.
    statements = [query["sql"] for query in queries if "SAVEPOINT" not in query["sql"]]
    lock = 'UPDATE "django_idempotency_inboxevent" SET "id" = "id" WHERE 0'
    assert statements == ([lock] if connection.vendor == "sqlite" else [])
