"""Processing inbox events: retries in the database, dead letters, lost triggers, races."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from celery import current_app
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import signals, tasks
from django_idempotency.backoff import exponential_bound
from django_idempotency.inbox import (
    ANY_TYPE,
    ProcessResult,
    dispatch_due,
    inbox_handler,
    mark_dead,
    process,
    receive,
    register_handler,
    reprocess,
    retry_now,
)
from django_idempotency.inbox import processing as inbox_processing
from django_idempotency.inbox import receiving as inbox_receiving
from django_idempotency.inbox.handlers import get_handler, unregister
from django_idempotency.inbox.processing import DISPATCH_GRACE
from django_idempotency.models import InboxEvent
from tests.factories import InboxEventFactory
from tests.inbox import deliver, refund_event
from tests.test_store import in_threads
from tests.testapp.models import LedgerEntry, Payment, Refund

pytestmark = pytest.mark.django_db(transaction=True)

BASE, CAP = 30.0, 6 * 3600.0


def lose_triggers(monkeypatch):
    """Lose every dispatch that follows a commit, as a crash right after it would."""
    for module in (inbox_receiving, inbox_processing):
        monkeypatch.setattr(module, "dispatch", lambda pk: None)


@pytest.fixture
def lost_triggers(monkeypatch):
    lose_triggers(monkeypatch)


def receive_then_roll_back():
    with transaction.atomic():
        receive("tests", "evt_1", "refund.succeeded", refund_event())
        raise RuntimeError


def later(seconds):
    return timezone.now() + timedelta(seconds=seconds)


def test_a_transient_failure_is_retried_with_full_jitter_until_it_succeeds():
    started = timezone.now()
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event(fail_times=3)).event.pk
    for attempt in range(1, 4):
        event = InboxEvent.objects.get(pk=pk)
        assert (event.status, event.attempts) == ("failed", attempt)
        # Drawn between zero and the bound, from the moment the attempt started.
        delay = (event.next_attempt_at - started).total_seconds()
        assert 0 <= delay <= exponential_bound(attempt, BASE, CAP)
        # Not due before its retry time; due from then on.
        assert dispatch_due(now=event.next_attempt_at - timedelta(microseconds=1)) == 0
        with _collect(signals.inbox_event_failed, signals.inbox_event_processed) as sent:
            started = timezone.now()
            assert dispatch_due(now=event.next_attempt_at) == 1
        assert len(sent) == 1

    event = InboxEvent.objects.get(pk=pk)
    assert (event.status, event.attempts) == ("processed", 4)
    assert Refund.objects.count() == 1


def test_the_first_attempt_that_raises_sends_failed_and_keeps_the_error():
    with _collect(signals.inbox_event_failed) as sent:
        receipt = receive("tests", "evt_1", "refund.succeeded", refund_event(fail_times=1))

    assert receipt.outcome is ProcessResult.FAILED
    assert [type(kwargs["error"]) for kwargs in sent] == [RuntimeError]
    assert sent[0]["event"].last_error == "RuntimeError: the ledger is unavailable (attempt 1)"


@override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 3})
def test_an_event_that_always_fails_is_dead_after_n_attempts_and_can_be_reprocessed():
    payload = refund_event(fail="always")
    with _collect(signals.inbox_event_dead) as dead:
        receipt = receive("tests", "evt_1", "refund.succeeded", payload)
        for _ in range(5):
            dispatch_due(now=later(CAP + 1))

    event = InboxEvent.objects.get()
    assert event.status == "dead"
    assert event.attempts == 3
    assert event.next_attempt_at is None
    assert event.payload == payload
    assert event.last_error == "RuntimeError: the ledger is unavailable (attempt 3)"
    assert [kwargs["event"].pk for kwargs in dead] == [receipt.event.pk]
    assert process(event.pk) is ProcessResult.SKIPPED
    assert not Refund.objects.exists()

    # The fix: the data the handler needs is there now.
    InboxEvent.objects.filter(pk=event.pk).update(payload=refund_event("evt_1"))
    assert reprocess(InboxEvent.objects.all()) == [event.pk]
    assert reprocess(InboxEvent.objects.filter(status="processing")) == []

    event.refresh_from_db()
    assert (event.status, event.attempts) == ("processed", 1)
    assert Refund.objects.count() == 1


def test_a_handler_that_raises_a_permanent_error_makes_the_event_dead_at_once():
    with _collect(signals.inbox_event_dead) as dead:
        receipt = receive("tests", "evt_1", "refund.succeeded", refund_event(fail="permanent"))

    event = InboxEvent.objects.get()
    assert (event.status, event.attempts, event.next_attempt_at) == ("dead", 1, None)
    assert event.last_error == "PermanentError: payment None does not exist"
    assert "PermanentError" in event.last_traceback
    assert [kwargs["event"].pk for kwargs in dead] == [receipt.event.pk]
    assert dispatch_due(now=later(CAP + 1)) == 0


def test_a_failed_event_can_be_retried_now_or_marked_dead():
    receive("tests", "evt_1", "refund.succeeded", refund_event(fail_times=1))
    receive("tests", "evt_2", "refund.succeeded", refund_event(fail="always"))

    first = InboxEvent.objects.filter(event_id="evt_1")
    assert retry_now(first) == [first.get().pk]
    assert mark_dead(InboxEvent.objects.all()) == [InboxEvent.objects.get(event_id="evt_2").pk]
    assert mark_dead(InboxEvent.objects.all()) == []

    statuses = dict(InboxEvent.objects.values_list("event_id", "status"))
    assert statuses == {"evt_1": "processed", "evt_2": "dead"}
    assert dispatch_due(now=later(CAP + 1)) == 0


def test_rolled_back_with_the_callers_transaction_nothing_is_recorded_or_processed():
    with pytest.raises(RuntimeError):
        receive_then_roll_back()

    assert not InboxEvent.objects.exists()
    assert not Refund.objects.exists()


def test_processing_waits_for_the_callers_commit():
    with transaction.atomic():
        receipt = receive("tests", "evt_1", "refund.succeeded", refund_event())
        assert receipt.outcome is None
        assert not Refund.objects.exists()

    assert receipt.outcome is ProcessResult.PROCESSED
    assert Refund.objects.count() == 1


def test_an_event_whose_trigger_was_lost_is_dispatched_by_the_periodic_run(monkeypatch):
    lose_triggers(monkeypatch)
    receive("tests", "evt_1", "refund.succeeded", refund_event())
    assert InboxEvent.objects.get().status == "received"
    # Not before the grace period: its trigger may still be on its way.
    assert dispatch_due(now=later(DISPATCH_GRACE.total_seconds() - 1)) == 0
    # The periodic run's own dispatch is lost too: the event comes due again, a grace later.
    assert dispatch_due(now=later(DISPATCH_GRACE.total_seconds() + 1)) == 1
    assert dispatch_due(now=later(DISPATCH_GRACE.total_seconds() + 1)) == 0
    monkeypatch.undo()

    assert dispatch_due(now=later(3 * DISPATCH_GRACE.total_seconds())) == 1

    assert InboxEvent.objects.get().status == "processed"
    assert Refund.objects.count() == 1


def test_an_attempt_whose_worker_died_counts_and_the_event_is_retried(monkeypatch):
    lose_triggers(monkeypatch)
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event()).event.pk
    monkeypatch.undo()
    # A worker claims the event, then dies before its handler's transaction commits.
    claimed = inbox_processing._claim(pk, "default", timezone.now(), lambda: 0.5)
    assert (claimed.status, claimed.attempts) == ("processing", 1)
    assert dispatch_due(now=claimed.next_attempt_at - timedelta(seconds=1)) == 0

    assert dispatch_due(now=claimed.next_attempt_at + timedelta(seconds=1)) == 1

    event = InboxEvent.objects.get()
    assert (event.status, event.attempts) == ("processed", 2)
    assert Refund.objects.count() == 1


@override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 2})
def test_an_event_that_kills_its_worker_every_time_ends_dead():
    # Its worker died during attempt 2.
    pk = InboxEventFactory(
        event_type="refund.succeeded", payload=refund_event(fail="always"), claimed=True, attempts=2
    ).pk

    with _collect(signals.inbox_event_dead) as dead:
        assert process(pk) is ProcessResult.DEAD

    event = InboxEvent.objects.get()
    assert event.status == "dead"
    assert event.last_error == "The worker stopped during attempt 2."
    assert dead[0]["error"] is None


def test_an_attempt_taken_over_between_its_two_transactions_leaves_the_event_alone():
    pk = InboxEventFactory(event_id="evt_1").pk
    first = inbox_processing._claim(pk, "default", timezone.now(), lambda: 0.0)
    second = inbox_processing._claim(pk, "default", timezone.now(), lambda: 0.0)

    assert inbox_processing._attempt(first, "default") is ProcessResult.SKIPPED
    assert inbox_processing._attempt(second, "default") is ProcessResult.PROCESSED
    assert InboxEvent.objects.get().attempts == 2


def test_purge_deletes_old_processed_events_only():
    old = timezone.now() - timedelta(days=40)
    for n, status in enumerate(["processed", "processed", "failed", "dead", "processed"]):
        processed_at = old if n < 4 else timezone.now()
        InboxEventFactory(event_id=f"evt_{n}", status=status, processed_at=processed_at)

    purged = InboxEvent.objects.purge_processed(
        older_than=timezone.now() - timedelta(days=30), batch_size=1
    )

    assert purged == 2
    remaining = InboxEvent.objects.order_by("event_id").values_list("event_id", flat=True)
    assert list(remaining) == ["evt_2", "evt_3", "evt_4"]


def test_handlers_register_per_source_and_type_with_a_fallback():
    @inbox_handler("other", "a.b", "c.d")
    def specific(event):
        pass

    @inbox_handler("other", ANY_TYPE)
    def fallback(event):
        pass

    try:
        assert get_handler("other", "a.b") is specific
        assert get_handler("other", "c.d") is specific
        assert get_handler("other", "x.y") is fallback
        assert get_handler("tests", "x.y") is None
        # The same function registered again, as a module imported twice would, is no conflict.
        inbox_handler("other", "a.b")(specific)
        with pytest.raises(Exception, match="already does"):
            inbox_handler("other", "a.b")(fallback)
        with pytest.raises(TypeError):
            inbox_handler("other")
    finally:
        unregister("other", "a.b", "c.d", ANY_TYPE)


def test_a_handler_made_by_a_factory_is_registered_for_one_type_without_a_decorator():
    def forward_to(queue):
        def handler(event):
            return queue

        return handler

    builds = forward_to("builds")
    register_handler("other", "push", builds)
    try:
        assert get_handler("other", "push") is builds
        with pytest.raises(Exception, match="already does"):
            register_handler("other", "push", lambda event: None)
    finally:
        unregister("other", "push")


# PostgreSQL: real threads, each with its own connection.


@pytest.mark.server_db
def test_fifty_concurrent_deliveries_of_one_event_record_it_once_and_process_it_once():
    payload = refund_event()

    statuses = in_threads(50, lambda _: deliver(payload).status_code)

    assert statuses == [200] * 50
    assert InboxEvent.objects.count() == 1
    assert InboxEvent.objects.get().status == "processed"
    assert Refund.objects.count() == 1


@pytest.mark.server_db
def test_a_duplicate_delivery_being_recorded_does_not_make_processing_step_aside(lost_triggers):
    # MariaDB's insert locks the row a duplicate finds, for as long as its transaction lasts.
    payload = refund_event()
    pk = receive("tests", payload["id"], "refund.succeeded", payload).event.pk
    locked, done = threading.Event(), threading.Event()

    def duplicate():
        try:
            with transaction.atomic():
                receive("tests", payload["id"], "refund.succeeded", payload)
                locked.set()
                time.sleep(0.3)
        finally:
            done.set()
            connection.close()

    threading.Thread(target=duplicate).start()
    assert locked.wait(5)
    assert process(pk) is ProcessResult.PROCESSED
    assert done.wait(5)
    assert Refund.objects.count() == 1


@pytest.mark.server_db
def test_the_processing_task_delivered_twice_at_once_has_its_effect_once(lost_triggers):
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event(sleep_first=0.5)).event.pk

    outcomes = in_threads(2, lambda _: process(pk))

    assert sorted(outcomes) == [ProcessResult.PROCESSED, ProcessResult.SKIPPED]
    assert Refund.objects.count() == 1
    # 2 when the second claimed the event between the first's claim and its handler's lock:
    # then the first stepped aside.
    assert InboxEvent.objects.get().attempts in (1, 2)


@pytest.mark.server_db
def test_the_periodic_run_skips_an_event_mid_attempt(lost_triggers):
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event(sleep_first=1.0)).event.pk
    worker = threading.Thread(target=_process_and_close, args=(pk,))
    worker.start()
    _wait_for(lambda: InboxEvent.objects.get(pk=pk).status == "processing")
    time.sleep(0.1)  # the attempt's second transaction holds the row

    dispatched = dispatch_due(now=later(CAP + 1))
    worker.join()

    assert dispatched == 0
    event = InboxEvent.objects.get()
    assert (event.status, event.attempts) == ("processed", 1)
    assert Refund.objects.count() == 1


@pytest.mark.server_db
def test_two_periodic_runs_at_once_dispatch_each_event_once(lost_triggers):
    for n in range(200):
        receive("tests", f"evt_{n}", "customer.created", {"n": n})

    counts = in_threads(2, lambda _: dispatch_due(now=later(120), limit=150))

    # Each run skips the rows the other has locked; how they share the events depends on how
    # their scans interleave (on MariaDB, row by row), but no event goes to both.
    assert sum(counts) == 200
    assert max(counts) <= 150
    assert dispatch_due(now=later(120)) == 0


def _process_and_close(pk):
    try:
        process(pk)
    finally:
        connection.close()


def _wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class _collect:
    """Collect the keyword arguments of every signal sent while in the block."""

    def __init__(self, *signals_):
        self.signals = signals_
        self.sent = []

    def receive(self, **kwargs):
        self.sent.append(kwargs)

    def __enter__(self):
        for signal in self.signals:
            signal.connect(self.receive)
        return self.sent

    def __exit__(self, *exc):
        for signal in self.signals:
            signal.disconnect(self.receive)


@override_settings(IDEMPOTENCY={"INBOX_RUNNER": "celery"})
def test_with_celery_the_event_is_enqueued_after_commit_and_never_after_a_rollback(monkeypatch):
    enqueued = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args: enqueued.append((name, args)))

    with pytest.raises(RuntimeError):
        receive_then_roll_back()
    assert enqueued == []

    with transaction.atomic():
        receipt = receive("tests", "evt_1", "refund.succeeded", refund_event())
        assert enqueued == []
    assert enqueued == [("django_idempotency.process_inbox_event", (receipt.event.pk,))]
    assert receipt.outcome is None


def test_an_event_of_a_source_without_any_handler_fails_rather_than_being_lost():
    receipt = receive("unknown-source", "evt_1", "anything", {"id": "evt_1"})

    assert receipt.outcome is ProcessResult.FAILED
    event = InboxEvent.objects.get()
    assert event.status == "failed"
    assert event.last_error.startswith(
        "ImproperlyConfigured: No inbox handler is registered for 'unknown-source' events."
    )


def test_each_decision_is_logged_with_structured_fields(caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.inbox")
    payload = refund_event("evt_1")

    receive("tests", "evt_1", "refund.succeeded", payload)
    receive("tests", "evt_1", "refund.succeeded", payload)

    records = [(r.getMessage(), r.idempotency_outcome) for r in caplog.records]
    assert records == [
        ("recorded inbox event evt_1 from tests", "received"),
        ("processed inbox event evt_1", "processed"),
        ("inbox event evt_1 from tests delivered again", "duplicate"),
    ]
    assert all(r.idempotency_source == "tests" for r in caplog.records)
    assert "500" not in caplog.text  # nothing of the payload


@override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 2})
def test_a_failed_event_past_a_lowered_limit_ends_dead_keeping_its_error():
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event(fail="always")).event.pk
    InboxEvent.objects.filter(pk=pk).update(attempts=3)

    assert process(pk) is ProcessResult.DEAD
    event = InboxEvent.objects.get()
    assert event.last_error == "RuntimeError: the ledger is unavailable (attempt 1)"


def test_the_tasks_and_the_command_run_in_process(monkeypatch):
    lose_triggers(monkeypatch)
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event()).event.pk
    monkeypatch.undo()
    InboxEventFactory(old=True)

    assert tasks.process_inbox_event(pk) == "processed"
    assert tasks.dispatch_due_inbox_events() == 0
    assert tasks.purge_processed_inbox_events() == 1
    out = StringIO()
    call_command("idempotency_inbox", stdout=out)
    call_command("idempotency_inbox", "--no-purge", "--limit", "5", stdout=out)
    assert out.getvalue().splitlines() == [
        "Dispatched 0 due inbox events.",
        "Purged 0 processed inbox events.",
        "Dispatched 0 due inbox events.",
    ]


def test_a_purge_stops_at_its_time_limit():
    InboxEventFactory(old=True)

    assert InboxEvent.objects.purge_processed(older_than=timezone.now(), max_seconds=0) == 0
    assert InboxEvent.objects.purge_processed(older_than=timezone.now()) == 1


@pytest.fixture
def handler(request):
    """Register the test's handler for the "effects" source; forget it afterwards."""
    registered = []

    def register(function):
        register_handler("effects", ANY_TYPE, function)
        registered.append(function)
        return function

    yield register
    unregister("effects", ANY_TYPE)


def write_then_mark_for_rollback(event):
    Refund.objects.create(event_id=event.event_id, amount=1)
    transaction.set_rollback(True)


def write_then_swallow_a_database_error(event):
    Refund.objects.create(event_id=event.event_id, amount=1)
    # No inner atomic block: Django marks the handler's transaction for rollback.
    with contextlib.suppress(IntegrityError):
        LedgerEntry.objects.create(payment_id=None, amount=1)


@pytest.mark.parametrize(
    "body", [write_then_mark_for_rollback, write_then_swallow_a_database_error]
)
def test_a_handler_whose_writes_were_rolled_back_has_failed_not_processed(handler, body):
    handler(body)
    event = receive("effects", "evt_1", "thing.happened", {"n": 1}).event
    event.refresh_from_db()
    assert (event.status, event.attempts) == ("failed", 1)
    assert "marked for rollback" in event.last_error
    assert Refund.objects.count() == 0


@pytest.mark.skipif(
    connection.vendor == "mysql", reason="InnoDB checks foreign keys at once, not at COMMIT"
)
def test_a_handler_whose_writes_fail_at_commit_has_failed_and_is_retried(handler):
    # Django's foreign keys are deferred to the COMMIT on PostgreSQL and SQLite: the handler
    # returns, and the transaction that would record it processed fails.
    handler(lambda event: LedgerEntry.objects.create(payment_id=event.payload["payment"], amount=1))
    with override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 2}):
        event = receive("effects", "evt_1", "thing.happened", {"payment": 424242}).event
        event.refresh_from_db()
        assert (event.status, event.attempts) == ("failed", 1)
        assert event.last_error.startswith("IntegrityError")
        assert event.next_attempt_at > timezone.now()
        assert process(event.pk, now=event.next_attempt_at) == ProcessResult.DEAD
    event.refresh_from_db()
    assert (event.status, event.attempts, event.next_attempt_at) == ("dead", 2, None)
    assert event.last_error.startswith("IntegrityError")
    # Once the payment exists, a person's reprocess goes through.
    Payment.objects.create(pk=424242, amount=1)
    reprocess(InboxEvent.objects.filter(pk=event.pk))
    event.refresh_from_db()
    assert event.status == "processed"
    assert LedgerEntry.objects.get().payment_id == 424242


def test_a_handler_error_whose_message_no_database_stores_is_kept_mended(handler):
    def handler_raising(event):
        raise ValueError("the provider said \x00\ud800")

    handler(handler_raising)
    event = receive("effects", "evt_1", "thing.happened", {"n": 1}).event
    event.refresh_from_db()
    assert (event.status, event.attempts) == ("failed", 1)
    assert event.last_error == "ValueError: the provider said \ufffd\ufffd"
    assert "\x00" not in event.last_traceback
