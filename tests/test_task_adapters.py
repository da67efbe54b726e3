"""The idempotent task's contract, the same through both adapters: Celery's
(``django_idempotency.celery``) and Django's Tasks framework's
(``django_idempotency.django_tasks``).

Each task here is declared twice from one body, once by each adapter; a test runs it through the
adapter its parameter names, in the test's own process (Celery's eager ``apply``, the framework's
immediate backend).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.core import optional
from django_idempotency.keys import downstream_key
from django_idempotency.models import IdempotencyKey
from tests.conftest import CI
from tests.testapp.models import Refund

if not optional.installed("django.tasks") and not optional.installed("django_tasks"):
    if CI:
        pytest.fail("Django's Tasks framework is not installed", pytrace=False)
    pytest.skip("needs django-tasks before Django 6.0", allow_module_level=True)

from django_idempotency import celery, django_tasks
from django_idempotency.exceptions import (
    TaskKeyInvalid,
    TaskKeyMissing,
    TaskPayloadMismatch,
)

RUNS: list[str] = []
ADAPTERS = ("celery", "django_tasks")


class Boom(Exception):
    pass


class Both:
    """One body declared by both adapters."""

    def __init__(self, body, **options):
        self.body = body
        self.tasks = {
            "celery": celery.idempotent_task(name=f"tests.adapters.{body.__name__}", **options)(
                body
            ),
            "django_tasks": django_tasks.idempotent_task(**options)(body),
        }

    def name(self, adapter):
        if adapter == "celery":
            return f"tests.adapters.{self.body.__name__}"
        return f"{self.body.__module__}.{self.body.__qualname__}"

    def __call__(self, adapter, *args, **kwargs):
        """Run the task in this process; return its result, or raise what it raised."""
        task = self.tasks[adapter]
        if adapter == "celery":
            return task.apply(args, kwargs).get()
        result = task.enqueue(*args, **kwargs)
        if result.errors:
            error = result.errors[0]
            raise error.exception_class(error.traceback)
        return result.return_value


def both(**options):
    return lambda body: Both(body, **options)


@both()
def record(label, amount=1):
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=amount)
    return {"label": label, "amount": amount, "run": len(RUNS)}


@both(key=lambda label, **_: f"record-{label}")
def record_by_label(label, amount=1):
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=amount)
    return len(RUNS)


@both(key=lambda tenant, label: label, tenant=lambda tenant, label: tenant)
def tenant_record(tenant, label):
    RUNS.append(f"{tenant}:{label}")
    return tenant


@both()
def explode(label, fail):
    Refund.objects.create(event_id=label, amount=1)
    if fail:
        raise Boom(label)
    return "done"


@both(key=lambda order: f"order-{order}")
def charge(order, idempotency_key):
    RUNS.append(idempotency_key)
    return {"key": idempotency_key, "downstream": idempotency_key.downstream_key}


@both(mode="lease", lease_timeout=1)
def lease_record(label, fail=False):
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=1)
    if fail:
        raise Boom(label)
    return {"label": label}


def recover_charge(label, *, key, attempt):
    RUNS.append(f"recover:{attempt}")
    return {"label": label, "recovered": True} if label.startswith("sent") else None


@both(mode="lease", lease_timeout=1, recover=recover_charge)
def lease_recovering(label):
    RUNS.append(label)
    return {"label": label, "recovered": False}


@both(mode="lease", wait_timeout=0.1, on_busy="skip")
def skipping():
    RUNS.append("ran")
    return 1


@pytest.fixture(autouse=True)
def _runs():
    RUNS.clear()
    yield
    RUNS.clear()


@pytest.fixture(params=ADAPTERS)
def adapter(request):
    return request.param


def key_row(**lookup):
    return IdempotencyKey.objects.get(**lookup)


def hold(key):
    """Leave ``key`` held by a live lease, as a run still in its body does."""
    IdempotencyKey.objects.filter(key=key).update(
        state="in_progress", locked_until=timezone.now() + timedelta(seconds=30)
    )


def abandon(key):
    """Leave ``key`` as a worker that died mid-body would: in progress, its lease run out."""
    IdempotencyKey.objects.filter(key=key).update(
        state="in_progress", locked_until=timezone.now() - timedelta(seconds=1)
    )


@pytest.mark.django_db(transaction=True)
def test_a_second_run_with_one_key_returns_the_first_runs_result(adapter):
    first = record(adapter, "a", idempotency_key="k1", amount=5)
    second = record(adapter, "a", idempotency_key="k1", amount=5)

    assert first == second == {"label": "a", "amount": 5, "run": 1}
    assert RUNS == ["a"]
    assert Refund.objects.count() == 1
    row = key_row(key="k1")
    name = record.name(adapter)
    assert (row.method, row.route, row.scope, row.state) == (
        "TASK",
        name,
        f"task:{name}",
        "succeeded",
    )


@pytest.mark.django_db(transaction=True)
def test_the_key_comes_from_the_arguments_and_the_callers_key_wins(adapter):
    assert record_by_label(adapter, "x") == 1
    assert record_by_label(adapter, "x") == 1
    assert record_by_label(adapter, "x", idempotency_key="given") == 2
    assert RUNS == ["x", "x"]
    keys = set(IdempotencyKey.objects.values_list("key", flat=True))
    assert keys == {"record-x", "given"}


@pytest.mark.django_db(transaction=True)
def test_other_keys_other_tasks_and_other_tenants_run_apart(adapter):
    record(adapter, "a", idempotency_key="k1")
    record(adapter, "a", idempotency_key="k2")
    record_by_label(adapter, "a", idempotency_key="k1")  # another task: another scope
    tenant_record(adapter, "acme", "1")
    tenant_record(adapter, "globex", "1")
    tenant_record(adapter, "acme", "1")
    assert RUNS == ["a", "a", "a", "acme:1", "globex:1"]
    assert key_row(scope=f"task:{tenant_record.name(adapter)}|tenant:acme").key == "1"


@pytest.mark.django_db(transaction=True)
def test_the_body_gets_its_key_with_a_downstream_key(adapter):
    first = charge(adapter, 7)
    again = charge(adapter, 7)

    assert first == again
    assert first["key"] == "order-7"
    assert first["downstream"] == downstream_key(f"task:{charge.name(adapter)}", "order-7")
    assert RUNS == ["order-7"]


@pytest.mark.django_db(transaction=True)
def test_a_key_reused_with_other_arguments_is_refused_and_nothing_runs(adapter):
    record(adapter, "a", idempotency_key="k1")
    with pytest.raises(TaskPayloadMismatch):
        record(adapter, "b", idempotency_key="k1")
    assert RUNS == ["a"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bad", [None, "", True, 1.5])
def test_a_missing_or_wrong_key_is_refused(adapter, bad):
    with pytest.raises((TaskKeyMissing, TaskKeyInvalid)):
        record(adapter, "a", idempotency_key=bad)
    assert RUNS == []


@pytest.mark.django_db(transaction=True)
def test_a_body_that_raises_rolls_back_and_releases_the_key(adapter):
    with pytest.raises(Boom):
        explode(adapter, "a", True, idempotency_key="k1")
    assert not Refund.objects.exists()
    assert not IdempotencyKey.objects.exists()
    assert explode(adapter, "b", False, idempotency_key="k2") == "done"
    assert explode(adapter, "b", False, idempotency_key="k2") == "done"
    assert Refund.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_outcomes_are_signalled_alike(adapter):
    seen = []

    def receiver(sender, **kwargs):
        seen.append((kwargs["outcome"], kwargs["task"], kwargs["key"], kwargs["attempt"]))

    signals.task_decided.connect(receiver)
    try:
        record(adapter, "a", idempotency_key="k1")
        record(adapter, "a", idempotency_key="k1")
        with pytest.raises(Boom):
            explode(adapter, "a", True, idempotency_key="k2")
    finally:
        signals.task_decided.disconnect(receiver)
    assert seen == [
        ("stored", record.name(adapter), "k1", 1),
        ("replayed", record.name(adapter), "k1", 2),
        ("not_stored", explode.name(adapter), "k2", 1),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_task_runs_once_and_a_failed_run_releases_the_key(adapter):
    assert lease_record(adapter, "a", idempotency_key="k") == {"label": "a"}
    assert lease_record(adapter, "a", idempotency_key="k") == {"label": "a"}
    with pytest.raises(Boom):
        lease_record(adapter, "b", True, idempotency_key="f")
    assert RUNS == ["a", "b"]
    assert key_row(key="k").state == "succeeded"
    assert key_row(key="f").state == "failed"
    assert Refund.objects.count() == 1  # the failed run's write rolled back


@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_task_refuses_to_run_inside_a_transaction(adapter):
    with transaction.atomic(), pytest.raises(ImproperlyConfigured, match="inside a transaction"):
        lease_record(adapter, "a", idempotency_key="k")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("label", "runs"), [("sent-1", 1), ("lost-1", 2)])
def test_a_lease_that_ran_out_is_taken_over_after_the_recover_hook(adapter, label, runs):
    lease_recovering(adapter, label, idempotency_key="k")
    abandon("k")
    again = lease_recovering(adapter, label, idempotency_key="k")

    assert again == {"label": label, "recovered": runs == 1}
    assert RUNS.count(label) == runs
    assert "recover:2" in RUNS


@pytest.mark.django_db(transaction=True)
def test_on_busy_skip_leaves_the_key_to_the_run_that_holds_it(adapter):
    skipping(adapter, idempotency_key="k")
    hold("k")
    assert skipping(adapter, idempotency_key="k") is None
    assert RUNS == ["ran"]


def test_wrong_options_are_refused_when_the_task_is_declared(adapter):
    declare = {"celery": celery, "django_tasks": django_tasks}[adapter].idempotent_task
    with pytest.raises(ImproperlyConfigured, match="recover hook"):
        declare(recover=recover_charge)(record.body)
    with pytest.raises(ImproperlyConfigured, match="on_busy"):
        declare(on_busy="wait")(record.body)
