"""The lifecycle tasks, executed by a real Celery worker over a Redis broker, on PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import override_settings
from django.utils import timezone

from django_idempotency.inbox import dispatch_due, receive
from django_idempotency.models import IdempotencyKey, InboxEvent
from django_idempotency.tasks import (
    dispatch_due_inbox_events,
    process_inbox_event,
    purge_expired_keys,
    purge_processed_inbox_events,
    sweep_expired_leases,
)
from tests.celery_app import app
from tests.conftest import process_env
from tests.factories import IdempotencyKeyFactory, InboxEventFactory
from tests.inbox import deliver, refund_event
from tests.test_purging import make_many_keys
from tests.testapp.models import Refund

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.server_db, pytest.mark.redis, pytest.mark.django_db(transaction=True)]


def start_worker():
    """Start a Celery worker on the test database; return its process once it answers."""
    env = process_env()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            "4",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=ROOT,
        env=env,
    )
    deadline = time.monotonic() + 60
    while not app.control.ping(timeout=0.5):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail("the Celery worker did not start")
    return process


@pytest.fixture
def worker():
    # The library's tasks are shared tasks: they are sent through the current Celery app, which
    # another test module's app may have become.
    app.set_current()
    app.control.purge()
    workers = [start_worker()]
    # A test may kill its worker and start another: stop whichever are running at the end.
    yield workers
    for process in workers:
        process.terminate()
        process.wait(timeout=30)


def run(task, **kwargs):
    """Send ``task`` to the worker; the tasks ignore results, which these tests read."""
    return task.apply_async(kwargs=kwargs, ignore_result=False)


def test_purge_fired_twice_at_once_then_again_ends_as_once(worker):
    expired = make_many_keys(20_000)
    first, second = run(purge_expired_keys, batch_size=1_000), run(purge_expired_keys)
    deleted = first.get(timeout=60) + second.get(timeout=60)
    again = [run(purge_expired_keys).get(timeout=60) for _ in range(2)]

    assert deleted == expired == 10_000
    assert again == [0, 0]
    assert IdempotencyKey.objects.count() == 10_000
    assert not IdempotencyKey.objects.filter(expires_at__lte=timezone.now()).exists()


def test_sweep_fired_twice_at_once_then_again_takes_each_lease_once(worker):
    IdempotencyKey.objects.bulk_create(IdempotencyKeyFactory.build_batch(500, lease_expired=True))
    results = [run(sweep_expired_leases), run(sweep_expired_leases)]
    swept = sum(result.get(timeout=60) for result in results)
    again = [run(sweep_expired_leases).get(timeout=60) for _ in range(2)]

    assert swept == 500
    assert again == [0, 0]
    assert IdempotencyKey.objects.filter(state="failed", lease_version=2).count() == 500


# The inbox with INBOX_RUNNER = "celery": the worker processes, the database keeps the schedule.

celery_runner = override_settings(IDEMPOTENCY={"INBOX_RUNNER": "celery"})


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@celery_runner
def test_a_delivered_event_is_processed_by_the_worker(worker):
    response = deliver(refund_event(amount=300))

    assert response.json() == {"status": "queued"}
    wait_for(lambda: InboxEvent.objects.get().status == "processed")
    assert list(Refund.objects.values_list("amount", flat=True)) == [300]


@celery_runner
def test_a_worker_killed_mid_processing_leaves_the_event_to_be_processed_once(worker):
    deliver(refund_event(sleep_first=60))
    wait_for(lambda: InboxEvent.objects.get().status == "processing")
    time.sleep(0.5)  # the handler has written its refund, uncommitted, and sleeps
    worker[0].kill()
    worker[0].wait()
    worker.append(start_worker())

    # The killed attempt's message waits for the broker's visibility timeout; the periodic
    # run finds the event once its retry time has come.
    event = InboxEvent.objects.get()
    assert dispatch_due(now=event.next_attempt_at + timedelta(seconds=1)) == 1

    wait_for(lambda: InboxEvent.objects.get().status == "processed")
    assert InboxEvent.objects.get().attempts == 2
    assert Refund.objects.count() == 1


@celery_runner
def test_an_event_whose_enqueue_was_lost_is_processed_by_the_periodic_task(worker, monkeypatch):
    # The process dies after the commit and before the enqueue.
    monkeypatch.setattr(app, "send_task", lambda name, args: None)
    deliver(refund_event())
    monkeypatch.undo()
    assert InboxEvent.objects.get().status == "received"
    # A minute later, it is due.
    InboxEvent.objects.update(next_attempt_at=timezone.now() - timedelta(seconds=1))

    dispatched = run(dispatch_due_inbox_events).get(timeout=60)

    assert dispatched == 1
    wait_for(lambda: InboxEvent.objects.get().status == "processed")
    assert Refund.objects.count() == 1


@celery_runner
def test_the_processing_task_delivered_twice_at_once_has_its_effect_once(worker, monkeypatch):
    monkeypatch.setattr(app, "send_task", lambda name, args: None)
    pk = receive("tests", "evt_1", "refund.succeeded", refund_event(sleep_first=1)).event.pk
    monkeypatch.undo()

    results = [run(process_inbox_event, event_pk=pk) for _ in range(2)]

    assert sorted(result.get(timeout=60) for result in results) == ["processed", "skipped"]
    assert Refund.objects.count() == 1


def test_the_inbox_purge_fired_twice_at_once_deletes_each_event_once(worker):
    InboxEvent.objects.bulk_create(InboxEventFactory.build_batch(3_000, old=True))

    results = [run(purge_processed_inbox_events), run(purge_processed_inbox_events)]

    assert sum(result.get(timeout=60) for result in results) == 3_000
    assert not InboxEvent.objects.exists()
