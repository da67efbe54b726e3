"""The "database" inbox runner: receiving records the event alone, a worker process runs it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import OperationalError, connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import tasks
from django_idempotency.inbox import receive, reprocess
from django_idempotency.inbox import worker as worker_module
from django_idempotency.inbox.processing import CHANNEL, process_due
from django_idempotency.inbox.worker import inbox_worker
from django_idempotency.models import InboxEvent
from django_idempotency.queue.worker import run_worker
from tests.conftest import BEHIND_PGBOUNCER, start_command, stop_commands
from tests.inbox import refund_event
from tests.testapp.models import Refund

pytestmark = pytest.mark.django_db(transaction=True)

database_runner = override_settings(IDEMPOTENCY={"INBOX_RUNNER": "database"})
# The databases a worker's connections reach: behind a pooler it listens on a direct alias.
LISTENING = ["default", "direct"] if BEHIND_PGBOUNCER else ["default"]


def record(count, **data):
    """Record ``count`` refund events as a receiver view would; return their event ids."""
    ids = []
    for n in range(count):
        payload = refund_event(f"evt_{n}", **data)
        receive("tests", payload["id"], "refund.succeeded", payload)
        ids.append(payload["id"])
    return ids


def later(seconds):
    return timezone.now() + timedelta(seconds=seconds)


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not _holds(condition):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _holds(condition):
    try:
        return condition()
    except OperationalError:
        # SQLite's shared in-memory test database locks a table a worker thread is writing.
        if connection.vendor != "sqlite":
            raise
        return False


@database_runner
def test_receiving_records_the_event_in_one_statement_and_leaves_it_due_at_once():
    payload = refund_event("evt_1")
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        receipt = receive("tests", "evt_1", "refund.succeeded", payload)

    statements = [query["sql"] for query in queries.captured_queries]
    inserts = [sql for sql in statements if "INSERT" in sql]
    assert len(inserts) == 1
    # On PostgreSQL the same statement wakes the workers, at the commit.
    assert len([sql for sql in statements if sql not in ("BEGIN", "COMMIT")]) == 1
    assert receipt.created
    assert receipt.outcome is None  # not processed in the request
    event = InboxEvent.objects.get()
    assert event.status == "received"
    assert event.next_attempt_at == event.received_at
    assert Refund.objects.count() == 0


@pytest.mark.postgresql
@database_runner
def test_a_new_event_wakes_the_workers_at_the_commit_and_a_duplicate_wakes_nobody():
    psycopg = pytest.importorskip("psycopg", reason="listens with psycopg 3's own connection")

    # The server itself: behind a pooler, notifications do not reach a client.
    settings = connections["direct" if BEHIND_PGBOUNCER else "default"].settings_dict
    with psycopg.connect(
        host=settings["HOST"], port=settings["PORT"] or 5432, user=settings["USER"],
        dbname=settings["NAME"], autocommit=True,
    ) as listener:  # fmt: skip
        listener.execute(f"LISTEN {CHANNEL}")

        def notifications():
            return [n.channel for n in listener.notifies(timeout=0.5, stop_after=5)]

        with transaction.atomic():
            receive("tests", "evt_1", "refund.succeeded", refund_event("evt_1"))
            assert notifications() == []  # not before the commit
        assert notifications() == [CHANNEL]
        receipt = receive("tests", "evt_1", "refund.succeeded", refund_event("evt_1"))
        assert not receipt.created
        assert notifications() == []
        with transaction.atomic():
            receive("tests", "evt_2", "refund.succeeded", refund_event("evt_2"))
            transaction.set_rollback(True)
        assert notifications() == []


@database_runner
def test_process_due_runs_each_due_event_once_and_leaves_retries_for_their_time():
    ids = record(3)
    failing = refund_event("evt_failing", fail_times=1)
    receive("tests", "evt_failing", "refund.succeeded", failing)

    assert process_due(limit=10) == 4
    assert sorted(Refund.objects.values_list("event_id", flat=True)) == sorted(ids)
    assert InboxEvent.objects.get(event_id="evt_failing").status == "failed"
    assert process_due(limit=10) == 0  # the retry is not due yet

    assert process_due(limit=10, now=later(31)) == 1
    assert InboxEvent.objects.get(event_id="evt_failing").status == "processed"
    assert Refund.objects.count() == 4


@database_runner
def test_process_due_takes_at_most_its_limit_oldest_first():
    record(5)

    assert process_due(limit=2) == 2
    assert sorted(Refund.objects.values_list("event_id", flat=True)) == ["evt_0", "evt_1"]
    assert process_due(limit=10) == 3


@database_runner
def test_a_stop_asked_mid_batch_finishes_the_event_and_leaves_the_rest_due_at_once():
    record(4)
    asked = []

    def stop():
        asked.append(1)
        return len(asked) > 1  # asked before each event: stop after the first

    assert process_due(limit=10, stop=stop) == 4
    assert Refund.objects.count() == 1
    left = InboxEvent.objects.filter(status="received")
    assert left.count() == 3
    # Due now, not after the dispatch grace: another worker takes them at once.
    assert all(event.next_attempt_at <= timezone.now() for event in left)
    assert process_due(limit=10) == 3


@database_runner
def test_reprocessing_leaves_the_event_to_the_worker():
    record(1)
    process_due(limit=10)

    reprocess(InboxEvent.objects.all())

    assert Refund.objects.count() == 1  # not processed in this process
    event = InboxEvent.objects.get()
    assert (event.status, event.attempts) == ("received", 0)
    assert process_due(limit=10) == 1
    assert Refund.objects.count() == 2


@database_runner
def test_the_worker_processes_events_recorded_while_it_runs_and_stops_when_told():
    stop = threading.Event()
    # On PostgreSQL the notification wakes it long before the interval ends.
    interval = 30.0 if connection.vendor == "postgresql" else 0.1
    worker = threading.Thread(
        target=_run_and_close, kwargs={"stop": stop, "interval": interval, "batch_size": 2}
    )
    if connection.vendor == "sqlite":
        record(5)  # its shared in-memory test database refuses a write beside the worker's
    worker.start()
    try:
        time.sleep(0.5)  # the worker is waiting
        if connection.vendor != "sqlite":
            record(5)
        wait_for(lambda: Refund.objects.count() == 5, timeout=10)
    finally:
        stop.set()
        worker.join(timeout=interval + 10)
    assert not worker.is_alive()
    assert set(InboxEvent.objects.values_list("status", flat=True)) == {"processed"}


def _run_and_close(**kwargs):
    # Behind a pooler the worker listens on a direct connection, as the operations guide says.
    listen_using = kwargs.pop("listen_using", "direct" if BEHIND_PGBOUNCER else None)
    worker = inbox_worker(batch_size=kwargs.pop("batch_size", 50), listen_using=listen_using)
    try:
        run_worker(worker, **kwargs)
    finally:
        connection.close()


def test_the_command_without_forever_still_dispatches_once_and_purges():
    out = StringIO()
    call_command("idempotency_inbox", stdout=out)
    assert "Dispatched 0 due inbox events." in out.getvalue()


# Real processes, each with its own connection.


def start_workers(count, *extra):
    return [start_command("idempotency_inbox", "--forever", *extra) for _ in range(count)]


@pytest.mark.server_db
@database_runner
def test_three_workers_at_once_run_each_handler_exactly_once():
    workers = start_workers(3, "--batch-size", "10", "--interval", "0.2")
    try:
        ids = record(300)
        wait_for(lambda: not InboxEvent.objects.exclude(status="processed").exists(), 120)
    finally:
        codes, outputs = stop_commands(workers)

    assert codes == [0, 0, 0], outputs
    assert set(Counter(Refund.objects.values_list("event_id", flat=True)).values()) == {1}
    assert Refund.objects.count() == len(ids)
    assert set(InboxEvent.objects.values_list("attempts", flat=True)) == {1}
    # Each worker took its share: they ran side by side, not one after another.
    took = [int(out.count("Processed")) for out, _ in outputs]
    assert sum(1 for count in took if count) >= 2, outputs


@pytest.mark.server_db
@database_runner
def test_a_worker_stopped_mid_event_finishes_it_and_exits_cleanly():
    (worker,) = start_workers(1, "--interval", "0.2")
    try:
        receive("tests", "evt_slow", "refund.succeeded", refund_event("evt_slow", sleep_first=2))
        record(3)
        wait_for(lambda: InboxEvent.objects.filter(status="processing").exists())
        time.sleep(0.3)  # inside the handler
    finally:
        codes, outputs = stop_commands([worker])

    assert codes == [0], outputs
    event = InboxEvent.objects.get(event_id="evt_slow")
    assert (event.status, event.attempts) == ("processed", 1)
    assert Refund.objects.filter(event_id="evt_slow").count() == 1
    # The rest of its batch was not begun: due at once for the next worker.
    assert InboxEvent.objects.filter(status="received").count() == 3
    assert process_due(limit=10) == 3


@override_settings(IDEMPOTENCY={"INBOX_RUNNER": "database"})
def test_the_database_runner_passes_the_checks():
    call_command("check")  # raises SystemCheckError on an error


@override_settings(IDEMPOTENCY={"INBOX_RUNNER": "broker"})
def test_another_runner_is_refused_naming_the_three():
    with pytest.raises(SystemCheckError, match="'inline', 'celery' or 'database'"):
        call_command("check")


@database_runner
def test_a_worker_whose_run_fails_logs_it_and_carries_on(monkeypatch, caplog):
    runs = []

    def failing_once(**kwargs):
        runs.append(1)
        if len(runs) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return process_due(**kwargs)

    monkeypatch.setattr(worker_module, "process_due", failing_once)
    record(2)
    stop = threading.Event()
    worker = threading.Thread(target=_run_and_close, kwargs={"stop": stop, "interval": 0.05})
    worker.start()
    try:
        wait_for(lambda: Refund.objects.count() == 2, timeout=10)
    finally:
        stop.set()
        worker.join(timeout=10)

    assert "the inbox worker's run failed" in caplog.text


@database_runner
def test_the_periodic_run_processes_due_events_itself_as_a_worker_would():
    # So cron's idempotency_inbox, or Celery beat's dispatch task, can stand in for a worker.
    record(2)

    assert tasks.dispatch_due_inbox_events() == 2
    assert Refund.objects.count() == 2
    assert set(InboxEvent.objects.values_list("status", flat=True)) == {"processed"}


@pytest.mark.postgresql
@pytest.mark.django_db(transaction=True, databases=LISTENING)
@database_runner
def test_a_worker_whose_listening_connection_is_lost_listens_again():
    stop = threading.Event()
    worker = threading.Thread(target=_run_and_close, kwargs={"stop": stop, "interval": 30.0})
    worker.start()
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN django_idempotency_inbox' "
        "AND datname = current_database()"
    )
    seen = []

    def listeners():
        # Read once: the listening connection's last query may change between two reads.
        seen[:] = _rows(listening)
        return seen

    try:
        wait_for(listeners)
        (old_pid,) = seen[0]
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [old_pid])
        # Listening again on a new connection, well before the interval ends.
        wait_for(lambda: listeners() and seen[0][0] != old_pid, timeout=10)
        record(1)
        wait_for(lambda: Refund.objects.count() == 1, timeout=10)
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not worker.is_alive()


def _rows(sql):
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchall()


@pytest.mark.pgbouncer
@database_runner
def test_a_worker_listening_through_a_pooler_says_so_and_polls(caplog):
    stop = threading.Event()
    kwargs = {"stop": stop, "interval": 0.2, "listen_using": None}
    worker = threading.Thread(target=_run_and_close, kwargs=kwargs)
    worker.start()
    try:
        wait_for(lambda: "goes through a pooler" in caplog.text, timeout=10)
        record(1)
        wait_for(lambda: Refund.objects.count() == 1, timeout=10)
    finally:
        stop.set()
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert _rows(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%%' "
        "AND datname = current_database()"
    ) == [(0,)]
