"""Idempotent tasks of Django's Tasks framework (``django_idempotency.django_tasks``): what is
the framework's own. The contract shared with Celery's adapter is in test_task_adapters.py.

In this process: the immediate backend, and django-tasks-db's worker run here in batch mode.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from django_idempotency.core import optional
from django_idempotency.exceptions import TaskInProgress
from django_idempotency.models import IdempotencyKey, OutboxMessage
from tests.conftest import CI
from tests.testapp.models import Refund

if not optional.installed("django.tasks") and not optional.installed("django_tasks"):
    if CI:
        pytest.fail("Django's Tasks framework is not installed", pytrace=False)
    pytest.skip("needs django-tasks before Django 6.0", allow_module_level=True)

from django_idempotency.django_tasks import (
    framework,
    idempotent_task,
    lifecycle,
)

DATABASE_BACKEND = optional.installed("django_tasks_db")
needs_database_backend = pytest.mark.skipif(
    not DATABASE_BACKEND and not CI, reason="needs django-tasks-db"
)
RUNS: list[object] = []


@idempotent_task(key=lambda label: label)
def record(label):
    """Record a refund."""
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=1)
    return {"label": label}


@idempotent_task(key=lambda label: label, takes_context=True)
def with_context(context, label):
    RUNS.append(context.attempt)
    return {"result_id": context.task_result.id, "label": label}


@idempotent_task(key=lambda label: label, mode="lease", wait_timeout=0.1, busy_countdown=0.2)
def held(label):
    RUNS.append(label)
    return {"label": label}


@pytest.fixture(autouse=True)
def _runs():
    RUNS.clear()
    yield
    RUNS.clear()


def hold(key):
    """Leave ``key`` held by a live lease, as a run still in its body does."""
    IdempotencyKey.objects.filter(key=key).update(
        state="in_progress", locked_until=timezone.now() + timedelta(seconds=30)
    )


def run_worker():
    """Run django-tasks-db's worker here until no task is ready."""
    from django_tasks_db.management.commands.db_worker import Worker  # noqa: PLC0415

    Worker(
        queue_names=["default"],
        interval=0,
        batch=True,
        backend_name="database",
        startup_delay=False,
        max_tasks=None,
        worker_id="tests",
        excluded_queue_names=[],
    ).run()


def test_the_task_is_the_frameworks_and_keeps_the_bodys_name_and_docstring():
    assert isinstance(record, framework.base.Task)
    assert record.name == "record"
    assert record.func.__doc__ == "Record a refund."
    # A worker imports the task by this path: it must lead to the task itself.
    assert import_string(record.module_path) is record
    # The framework passes the context first; the body does not see it unless it asked.
    assert record.takes_context


@pytest.mark.django_db(transaction=True)
def test_a_body_that_asks_for_the_context_gets_it():
    first = with_context.enqueue("a")
    again = with_context.enqueue("a")

    assert first.return_value == again.return_value == {"result_id": first.id, "label": "a"}
    assert RUNS == [1]  # the attempt, as the framework counts them


class RolledBack(Exception):
    pass


def enqueue_and_roll_back():
    with transaction.atomic():
        transaction.on_commit(lambda: record.enqueue("rolled-back"))
        raise RolledBack


@pytest.mark.django_db(transaction=True)
def test_enqueued_on_commit_the_task_runs_with_the_change_that_caused_it():
    with transaction.atomic():
        Refund.objects.create(event_id="order", amount=1)
        transaction.on_commit(lambda: record.enqueue("on-commit"))
        assert RUNS == []
    assert RUNS == ["on-commit"]
    with pytest.raises(RolledBack):
        enqueue_and_roll_back()
    assert RUNS == ["on-commit"]


@pytest.mark.django_db(transaction=True)
def test_a_busy_run_on_a_backend_that_cannot_defer_fails_at_once():
    held.enqueue("k")
    hold("k")
    result = held.enqueue("k")

    assert result.status == "FAILED"
    assert result.errors[0].exception_class is TaskInProgress
    assert RUNS == ["k"]


@needs_database_backend
@pytest.mark.django_db(transaction=True)
def test_a_task_enqueued_20_times_on_the_database_backend_runs_once():
    results = [record.using(backend="database").enqueue("twenty") for _ in range(20)]
    run_worker()

    for result in results:
        result.refresh()
    assert {result.status for result in results} == {"SUCCESSFUL"}
    assert [result.return_value for result in results] == [{"label": "twenty"}] * 20
    assert RUNS == ["twenty"]
    assert Refund.objects.filter(event_id="twenty").count() == 1


@needs_database_backend
@pytest.mark.django_db(transaction=True)
def test_a_busy_run_is_enqueued_again_to_run_later_and_then_replays():
    held.enqueue("k")  # the immediate backend: stored
    hold("k")
    busy = held.using(backend="database").enqueue("k")
    run_worker()

    busy.refresh()
    assert busy.status == "FAILED"
    assert busy.errors[0].exception_class is TaskInProgress
    from django_tasks_db.models import DBTaskResult  # noqa: PLC0415

    again = DBTaskResult.objects.exclude(id=busy.id).get()
    assert again.status == "READY"
    assert again.run_after > timezone.now()
    assert str(again.id) in busy.errors[0].traceback
    assert again.args_kwargs == {"args": ["k"], "kwargs": {}}

    # The run that held the key finishes; the retry, once due, gets its result.
    IdempotencyKey.objects.filter(key="k").update(state="succeeded", locked_until=None)
    DBTaskResult.objects.filter(id=again.id).update(run_after=timezone.now())
    run_worker()
    retried = held.using(backend="database").get_result(str(again.id))
    assert retried.status == "SUCCESSFUL"
    assert retried.return_value == {"label": "k"}
    assert RUNS == ["k"]


@pytest.mark.django_db(transaction=True)
def test_the_periodic_work_runs_as_tasks():
    outcomes = {
        name: getattr(lifecycle, name).enqueue().return_value
        for name in (
            "purge_expired_keys",
            "sweep_expired_leases",
            "dispatch_due_inbox_events",
            "purge_processed_inbox_events",
            "relay_outbox",
            "purge_dispatched_outbox_messages",
        )
    }
    assert outcomes == dict.fromkeys(outcomes, 0)
    # An event that is not there (processed and purged, say) is skipped.
    assert lifecycle.process_inbox_event.enqueue(0).return_value == "skipped"
    # A worker imports each by its path.
    for name in lifecycle.__all__:
        task = getattr(lifecycle, name)
        assert import_string(task.module_path) is task


@pytest.mark.django_db(transaction=True)
def test_the_purge_task_deletes_expired_keys():
    record.enqueue("old")
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert lifecycle.purge_expired_keys.enqueue(batch_size=10).return_value == 1
    assert not IdempotencyKey.objects.exists()
    assert not OutboxMessage.objects.exists()


@needs_database_backend
@pytest.mark.django_db(transaction=True)
def test_the_enqueue_command_sends_a_periodic_task_to_the_worker(capsys):
    record.enqueue("old")
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    call_command(
        "idempotency_enqueue", "purge_expired_keys", "--backend", "database",
        "--kwargs", '{"batch_size": 10}',
    )  # fmt: skip
    assert "Enqueued purge_expired_keys as the task result" in capsys.readouterr().out
    assert IdempotencyKey.objects.exists()  # not yet: the worker runs it
    run_worker()
    assert not IdempotencyKey.objects.exists()


@pytest.mark.parametrize(("kwargs", "message"), [("{", "not JSON"), ("[1]", "a JSON object")])
def test_the_enqueue_command_refuses_keyword_arguments_that_are_not_a_json_object(kwargs, message):
    with pytest.raises(CommandError, match=message):
        call_command("idempotency_enqueue", "relay_outbox", "--kwargs", kwargs)
