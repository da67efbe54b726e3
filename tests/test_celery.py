"""Idempotent Celery tasks (``django_idempotency.celery``), run in the test's own process.

On every database; tests/test_celery_workers.py runs them on real workers, on PostgreSQL.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import InterfaceError, OperationalError, ProgrammingError, transaction
from django.http import JsonResponse
from django.test import RequestFactory, override_settings
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.celery import idempotent_task
from django_idempotency.core import canonical
from django_idempotency.core.correlation import get_correlation_id
from django_idempotency.core.engine import Engine
from django_idempotency.core.keyed_request import handle
from django_idempotency.core.store import KeyStore
from django_idempotency.core.task_runs import arguments_fingerprint
from django_idempotency.exceptions import (
    TaskInProgress,
    TaskKeyInvalid,
    TaskKeyMissing,
    TaskPayloadMismatch,
)
from django_idempotency.keys import downstream_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.policy import Policy
from tests.factories import IdempotencyKeyFactory
from tests.task_worker import refund
from tests.test_store import in_threads, leave_behind
from tests.testapp.models import Refund
from tests.testapp.views import lock_wait_bound

# Effects of the in-process tasks below, by label.
RUNS: list[str] = []


@idempotent_task(name="tests.record")
def record(label, amount=1):
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=amount)
    return {"label": label, "amount": amount, "run": len(RUNS)}


@idempotent_task(name="tests.record_by_label", key=lambda label, **_: f"record-{label}")
def record_by_label(label, amount=1):
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=amount)
    return len(RUNS)


@idempotent_task(
    name="tests.tenant_record",
    key=lambda tenant, label: label,
    tenant=lambda tenant, label: tenant,
)
def tenant_record(tenant, label):
    RUNS.append(f"{tenant}:{label}")
    return tenant


class Boom(Exception):
    pass


@idempotent_task(name="tests.explode", bind=True)
def explode(self, label, fail):
    Refund.objects.create(event_id=label, amount=1)
    if fail:
        raise Boom(self.name)
    return "done"


@idempotent_task(name="tests.lease_record", mode="lease", lease_timeout=1)
def lease_record(label, fail=False):
    RUNS.append(label)
    Refund.objects.create(event_id=label, amount=1)
    if fail:
        raise Boom(label)
    return {"label": label}


def recover_charge(label, *, key, attempt):
    RUNS.append(f"recover:{attempt}")
    return {"label": label, "recovered": True} if label.startswith("sent") else None


@idempotent_task(
    name="tests.lease_recovering", mode="lease", lease_timeout=1, recover=recover_charge
)
def lease_recovering(label):
    RUNS.append(label)
    return {"label": label, "recovered": False}


@pytest.fixture(autouse=True)
def _runs():
    RUNS.clear()
    yield
    RUNS.clear()


def key_row(**lookup):
    return IdempotencyKey.objects.get(**lookup)


# In process: the task body runs in the test's own process, on every database.


@pytest.mark.django_db(transaction=True)
def test_a_task_sent_twice_with_one_key_runs_once_and_the_duplicate_gets_the_stored_result(
    unwritten_counts,
):
    first = record.apply(("a",), {"idempotency_key": "k1", "amount": 5}).get()
    second = record.apply(("a",), {"idempotency_key": "k1", "amount": 5}).get()

    assert first == second == {"label": "a", "amount": 5, "run": 1}
    assert RUNS == ["a"]
    assert Refund.objects.count() == 1
    row = key_row(key="k1")
    assert (row.method, row.route, row.scope, row.state) == (
        "TASK",
        "tests.record",
        "task:tests.record",
        "succeeded",
    )
    assert json.loads(bytes(row.response_body)) == first
    unwritten_counts.flush()  # the replay counted in memory
    assert key_row(key="k1").replay_count == 1


@idempotent_task(name="tests.correlated")
def correlated():
    return get_correlation_id()


@pytest.mark.django_db(transaction=True)
def test_the_task_runs_with_the_correlation_id_of_its_message_headers():
    sent = correlated.apply(
        kwargs={"idempotency_key": "c1"}, headers={"X-Correlation-ID": "corr-1"}
    )
    forged = correlated.apply(
        kwargs={"idempotency_key": "c2"}, headers={"X-Correlation-ID": "a\nb"}
    )

    assert sent.get() == "corr-1"
    assert forged.get() is None
    assert get_correlation_id() is None  # bound while the task ran only


@pytest.mark.django_db(transaction=True)
def test_the_key_may_come_from_the_arguments():
    assert record_by_label("x") == 1
    assert record_by_label.apply(("x",)).get() == 1
    assert record_by_label("y") == 2
    assert RUNS == ["x", "y"]
    assert set(IdempotencyKey.objects.values_list("key", flat=True)) == {"record-x", "record-y"}


@pytest.mark.django_db(transaction=True)
def test_the_callers_key_wins_over_the_key_function():
    record_by_label("x", idempotency_key="explicit")
    record_by_label("x")
    assert RUNS == ["x", "x"]


@pytest.mark.django_db(transaction=True)
def test_other_keys_and_other_tasks_run_apart():
    record("a", idempotency_key="k1")
    record("a", idempotency_key="k2")
    record_by_label("a", idempotency_key="k1")  # another task: another scope
    assert RUNS == ["a", "a", "a"]


@pytest.mark.django_db(transaction=True)
def test_a_tenant_scopes_the_key():
    tenant_record("acme", "1")
    tenant_record("globex", "1")
    tenant_record("acme", "1")
    assert RUNS == ["acme:1", "globex:1"]
    assert key_row(scope="task:tests.tenant_record|tenant:acme").key == "1"


@idempotent_task(name="tests.charge_downstream", tenant=lambda tenant: tenant)
def charge_downstream(tenant, idempotency_key):
    return {"key": idempotency_key, "downstream": idempotency_key.downstream_key}


@pytest.mark.django_db(transaction=True)
def test_the_body_gets_its_key_with_a_downstream_key_of_the_keys_scope():
    acme = charge_downstream("acme", idempotency_key="k1")
    globex = charge_downstream("globex", idempotency_key="k1")
    replayed = charge_downstream("acme", idempotency_key="k1")

    scope = key_row(scope="task:tests.charge_downstream|tenant:acme").scope
    assert acme == replayed == {"key": "k1", "downstream": downstream_key(scope, "k1")}
    assert globex["downstream"] != acme["downstream"]


@pytest.mark.django_db(transaction=True)
def test_a_key_reused_with_other_arguments_is_refused_and_nothing_runs():
    record("a", idempotency_key="k1")
    with pytest.raises(TaskPayloadMismatch, match="other arguments"):
        record("b", idempotency_key="k1")
    assert RUNS == ["a"]


def test_the_fingerprint_is_the_canonical_hash_of_the_arguments():
    # How canonical JSON treats key order, large integers and dates is tested in test_canonical.
    assert arguments_fingerprint((1,), {"b": [1, 2], "a": 1}) == canonical.sha256(
        {"args": [1], "kwargs": {"a": 1, "b": [1, 2]}}
    )
    assert arguments_fingerprint((2**60,), {}) == canonical.sha256({"args": [2**60], "kwargs": {}})
    assert arguments_fingerprint((1,), {}) != arguments_fingerprint((2,), {})


def test_wrong_arguments_are_refused_when_the_task_is_sent():
    with pytest.raises(TypeError):
        record.apply_async(("a", 1, "extra"), {"idempotency_key": "k"})
    with pytest.raises(TypeError):
        explode.apply_async(("a",), {"idempotency_key": "k"})  # bound: self is not an argument
    with pytest.raises(TypeError):
        record.apply_async(("a",), {"idempotency_key": "k", "colour": "red"})


def test_the_task_keeps_the_bodys_name_and_docstring():
    assert record.name == "tests.record"
    assert refund.__doc__.startswith("Record a refund")


@pytest.mark.django_db(transaction=True)
def test_a_body_that_takes_the_key_gets_the_one_its_run_claimed():
    @idempotent_task(name="tests.charge", key=lambda order: f"order-{order}")
    def charge(order, idempotency_key):
        RUNS.append(idempotency_key)
        return idempotency_key

    assert charge(7) == "order-7"
    assert charge(7) == "order-7"
    assert charge(7, idempotency_key="given") == "given"
    assert RUNS == ["order-7", "given"]
    with pytest.raises(TypeError):
        charge.apply_async((7, "positional", "extra"))


@pytest.mark.django_db(transaction=True)
def test_a_task_without_a_key_is_refused():
    with pytest.raises(TaskKeyMissing, match="idempotency_key="):
        record("a")
    assert RUNS == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bad", ["", None, True, 1.5, ["k"]])
def test_a_key_that_is_not_a_string_or_an_integer_is_refused(bad):
    with pytest.raises((TaskKeyInvalid, TaskKeyMissing)):
        record("a", idempotency_key=bad)
    assert RUNS == []


@pytest.mark.django_db(transaction=True)
def test_an_integer_key_and_a_long_key_are_accepted():
    record("a", idempotency_key=7)
    record("a", idempotency_key="k" * 300)
    record("a", idempotency_key="k" * 300)
    assert RUNS == ["a", "a"]
    keys = set(IdempotencyKey.objects.values_list("key", flat=True))
    assert "7" in keys
    assert any(key.startswith("sha256:") for key in keys)


@pytest.mark.django_db(transaction=True)
def test_a_body_that_raises_rolls_back_and_releases_the_key():
    with pytest.raises(Boom):
        explode("a", True, idempotency_key="k1")
    assert Refund.objects.count() == 0
    assert not IdempotencyKey.objects.exists()
    # The retry (with the same key and arguments would fail again: here it succeeds).
    assert explode("b", False, idempotency_key="k2") == "done"
    assert explode("b", False, idempotency_key="k2") == "done"
    assert Refund.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_result_that_is_not_json_rolls_back_like_a_failure():
    @idempotent_task(name="tests.not_json")
    def not_json():
        Refund.objects.create(event_id="x", amount=1)
        return object()

    with pytest.raises(TypeError):
        not_json(idempotency_key="k")
    assert not Refund.objects.exists()
    assert not IdempotencyKey.objects.exists()


@idempotent_task(name="tests.lock_wait")
def report_lock_wait():
    return lock_wait_bound()


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("found", ["nothing", "expired", "failed"])
def test_the_body_runs_under_the_sessions_own_lock_wait(found):
    # The claim's bound on a duplicate's wait is the claim's alone, a takeover's too.
    session = lock_wait_bound()
    if found != "nothing":
        assert report_lock_wait(idempotency_key="k") == session
        leave_behind(found)

    assert report_lock_wait(idempotency_key="k") == session
    assert key_row().lease_version == (1 if found == "nothing" else 2)


@pytest.mark.django_db(transaction=True)
def test_past_its_ttl_a_key_runs_again():
    record("a", idempotency_key="k1")
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    record("a", idempotency_key="k1")
    assert RUNS == ["a", "a"]
    assert key_row(key="k1").expires_at > timezone.now() + timedelta(hours=23)


@pytest.mark.django_db(transaction=True)
def test_the_ttl_option_sets_the_expiry():
    @idempotent_task(name="tests.short_lived", ttl=60)
    def short_lived():
        return 1

    short_lived(idempotency_key="k")
    row = key_row(key="k")
    assert row.expires_at - row.created_at == timedelta(seconds=60)


@pytest.mark.django_db(transaction=True)
def test_with_idempotency_disabled_the_body_runs_every_time():
    with override_settings(IDEMPOTENCY={"ENABLED": False}):
        record("a", idempotency_key="k1")
        record("a", idempotency_key="k1")
    assert RUNS == ["a", "a"]
    assert not IdempotencyKey.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_outcomes_are_signalled():
    seen = []

    def receiver(sender, **kwargs):
        seen.append((kwargs["outcome"], kwargs["task"], kwargs["key"], kwargs["attempt"]))

    signals.task_decided.connect(receiver)
    try:
        record("a", idempotency_key="k1")
        record("a", idempotency_key="k1")
        with pytest.raises(TaskPayloadMismatch):
            record("b", idempotency_key="k1")
        with pytest.raises(Boom):
            explode("a", True, idempotency_key="k2")
    finally:
        signals.task_decided.disconnect(receiver)
    assert seen == [
        ("stored", "tests.record", "k1", 1),
        ("replayed", "tests.record", "k1", 2),
        ("mismatch", "tests.record", "k1", 1),
        ("not_stored", "tests.explode", "k2", 1),
    ]


@pytest.mark.django_db(transaction=True)
def test_metrics_count_task_outcomes():
    from django_idempotency.operations.metrics import TASKS  # noqa: PLC0415

    def count(outcome):
        return TASKS.labels(outcome=outcome, task="tests.record")._value.get()

    stored, replayed = count("stored"), count("replayed")
    record("a", idempotency_key="k1")
    record("a", idempotency_key="k1")
    assert (count("stored"), count("replayed")) == (stored + 1, replayed + 1)


@pytest.mark.django_db(transaction=True)
def test_the_admin_lists_task_keys_and_filters_them_by_the_task_method(admin_client):
    record("a", idempotency_key="task-key")
    IdempotencyKeyFactory(key="request-key", method="POST")
    changelist = "/admin/django_idempotency/idempotencykey/"

    page = admin_client.get(changelist, {"method": "TASK"})
    assert [row.key for row in page.context["cl"].result_list] == ["task-key"]
    assert ">task<" in page.content.decode()
    assert "tests.record" in page.content.decode()  # the route column shows the task


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "eager"}, "mode option"),
        ({"ttl": -1}, "ttl option"),
        ({"wait_timeout": "soon"}, "wait_timeout option"),
        ({"on_busy": "wait"}, "on_busy option"),
        ({"recover": recover_charge}, "recover hook is for lease mode"),
    ],
)
def test_wrong_options_are_refused_when_the_task_is_declared(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        idempotent_task(name="tests.wrong", **options)


@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_task_runs_once_and_replays():
    assert lease_record("a", idempotency_key="k") == {"label": "a"}
    assert lease_record("a", idempotency_key="k") == {"label": "a"}
    assert RUNS == ["a"]
    row = key_row(key="k")
    assert (row.state, row.method, row.lease_version) == ("succeeded", "TASK", 1)


@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_body_that_raises_releases_the_key_for_the_next_delivery():
    with pytest.raises(Boom):
        lease_record("a", True, idempotency_key="k")
    assert key_row(key="k").state == "failed"
    assert not Refund.objects.exists()  # the body's writes commit with the completion only
    with pytest.raises(Boom):
        lease_record("a", True, idempotency_key="k")
    assert key_row(key="k").attempts == 2


@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_task_refuses_to_run_inside_a_transaction():
    with transaction.atomic(), pytest.raises(ImproperlyConfigured, match="inside a transaction"):
        lease_record("a", idempotency_key="k")


def abandon(key):
    """Leave ``key`` as a worker that died mid-body would: in progress, its lease run out."""
    IdempotencyKey.objects.filter(key=key).update(
        state="in_progress", locked_until=timezone.now() - timedelta(seconds=1)
    )


@pytest.mark.django_db(transaction=True)
def test_a_lease_that_ran_out_is_taken_over_and_the_recover_hook_is_asked_first():
    lease_recovering("sent-1", idempotency_key="k")
    abandon("k")
    assert lease_recovering("sent-1", idempotency_key="k") == {
        "label": "sent-1",
        "recovered": True,
    }
    assert RUNS == ["sent-1", "recover:2"]


@pytest.mark.django_db(transaction=True)
def test_when_the_recover_hook_finds_nothing_the_body_runs_again():
    lease_recovering("lost-1", idempotency_key="k")
    abandon("k")
    assert lease_recovering("lost-1", idempotency_key="k") == {
        "label": "lost-1",
        "recovered": False,
    }
    assert RUNS == ["lost-1", "recover:2", "lost-1"]


@pytest.mark.django_db(transaction=True)
def test_the_sweeper_releases_a_task_lease_that_ran_out():
    lease_recovering("lost-1", idempotency_key="k")
    abandon("k")
    assert IdempotencyKey.objects.sweep_expired_leases() == 1
    assert key_row(key="k").state == "failed"


@pytest.mark.django_db(transaction=True)
def test_a_live_lease_makes_a_duplicate_retry_later():
    @idempotent_task(
        name="tests.lease_busy", mode="lease", lease_timeout=30, wait_timeout=0.1, max_retries=0
    )
    def lease_busy():
        return 1

    lease_busy(idempotency_key="k")
    IdempotencyKey.objects.filter(key="k").update(
        state="in_progress", locked_until=timezone.now() + timedelta(seconds=30)
    )
    with pytest.raises(TaskInProgress, match="holds the key"):
        lease_busy.apply(kwargs={"idempotency_key": "k"}).get()


@pytest.mark.django_db(transaction=True)
def test_an_atomic_task_whose_key_is_held_by_a_live_lease_retries_later():
    @idempotent_task(name="tests.held", wait_timeout=0.1, busy_countdown=5, max_retries=1)
    def held():
        RUNS.append("ran")
        return 1

    held(idempotency_key="k")
    # A delivery of this task in lease mode (before a deployment changed its mode) holds it.
    IdempotencyKey.objects.filter(key="k").update(
        state="in_progress", locked_until=timezone.now() + timedelta(seconds=30)
    )
    with pytest.raises(TaskInProgress):
        held.apply(kwargs={"idempotency_key": "k"}).get()
    assert RUNS == ["ran"]


@pytest.mark.django_db(transaction=True)
def test_a_release_that_fails_leaves_the_lease_to_run_out_and_the_bodys_error_stands(
    monkeypatch, caplog
):
    def unavailable(self, claim):
        raise OperationalError("the database went away")

    monkeypatch.setattr(KeyStore, "fail", unavailable)
    with pytest.raises(Boom):
        lease_record("a", True, idempotency_key="k")
    assert key_row(key="k").state == "in_progress"
    assert "its lease will run out" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_on_busy_skip_leaves_the_key_to_the_delivery_that_holds_it():
    @idempotent_task(name="tests.skipping", mode="lease", wait_timeout=0.1, on_busy="skip")
    def skipping():
        RUNS.append("ran")
        return 1

    skipping(idempotency_key="k")
    IdempotencyKey.objects.filter(key="k").update(
        state="in_progress", locked_until=timezone.now() + timedelta(seconds=30)
    )
    assert skipping(idempotency_key="k") is None
    assert RUNS == ["ran"]


@pytest.mark.django_db(transaction=True)
def test_a_lease_taken_over_while_the_body_ran_keeps_none_of_its_writes():
    @idempotent_task(name="tests.overtaken", mode="lease", wait_timeout=0.1, max_retries=0)
    def overtaken():
        Refund.objects.create(event_id="stale", amount=1)
        # Another delivery takes the key over meanwhile: the fence refuses this completion.
        IdempotencyKey.objects.filter(key="k").update(lease_version=99)
        return 1

    with pytest.raises(TaskInProgress):
        overtaken.apply(kwargs={"idempotency_key": "k"}).get()
    assert not Refund.objects.exists()


# One engine: an operation run through a view and through a task takes the same path.

OUTCOME_SIGNALS = [
    signals.key_stored,
    signals.key_replayed,
    signals.payload_mismatch,
    signals.request_in_progress,
    signals.response_not_stored,
    signals.task_decided,
]
BODY_RUNS: list[int] = []


def shared_body(amount):
    BODY_RUNS.append(amount)
    Refund.objects.create(event_id=f"run-{len(BODY_RUNS)}", amount=amount)
    return {"amount": amount, "run": len(BODY_RUNS)}


@idempotent_task(name="tests.shared", mode="lease", lease_timeout=30, wait_timeout=0.1)
def shared_task_body(amount):
    return shared_body(amount)


class ThroughAView:
    """Run ``shared_body`` as a lease-mode view; answer with its result or its problem code."""

    method = "POST"

    def __call__(self, amount, key="k"):
        request = RequestFactory().post(
            "/shared/", json.dumps({"amount": amount}), content_type="application/json"
        )
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        policy = Policy.from_settings(mode="lease", lease_timeout=30, wait_timeout=0.1)
        response = handle(
            request,
            lambda: JsonResponse(shared_body(amount)),
            engine=Engine(),
            policy=policy,
            sender=None,
        )
        answer = json.loads(response.content)
        return answer.get("code", answer)


class ThroughATask:
    """Run ``shared_body`` as a lease-mode task; answer with its result or its exception."""

    method = "TASK"

    def __call__(self, amount, key="k"):
        try:
            return shared_task_body.apply((amount,), {"idempotency_key": key}, retries=99).get()
        except (TaskPayloadMismatch, TaskInProgress) as exc:
            return type(exc).__name__


@pytest.fixture(params=[ThroughAView, ThroughATask])
def adapter(request):
    BODY_RUNS.clear()
    outcomes = []

    def receiver(sender, **kwargs):
        outcomes.append(kwargs["outcome"])

    for signal in OUTCOME_SIGNALS:
        signal.connect(receiver, weak=False, dispatch_uid="shared-outcomes")
    run = request.param()
    run.outcomes = outcomes
    yield run
    for signal in OUTCOME_SIGNALS:
        signal.disconnect(dispatch_uid="shared-outcomes")


@pytest.mark.django_db(transaction=True)
def test_a_view_and_a_task_store_replay_refuse_and_wait_alike(adapter):
    first = adapter(5)
    again = adapter(5)
    other = adapter(7)
    row = key_row(key="k")
    row.locked_until = timezone.now() + timedelta(seconds=30)
    row.state = "in_progress"
    row.save()
    busy = adapter(5)

    assert first == again == {"amount": 5, "run": 1}
    assert other in ("idempotency.payload_mismatch", "TaskPayloadMismatch")
    assert busy in ("idempotency.in_progress", "TaskInProgress")
    assert BODY_RUNS == [5]
    assert adapter.outcomes == ["stored", "replayed", "mismatch", "in_progress"]
    assert (row.method, row.lease_version, row.attempts, row.response_status) == (
        adapter.method,
        1,
        1,
        200,
    )
    assert json.loads(bytes(row.response_body)) == first


@pytest.mark.django_db(transaction=True)
def test_a_view_and_a_task_whose_lease_was_taken_over_answer_with_the_new_owners_result(
    adapter, monkeypatch
):
    def take_over():
        # Another delivery of the same key, after this one's lease (as it seems) ran out.
        IdempotencyKey.objects.filter(key="k").update(locked_until=timezone.now())
        return adapter(5)

    real_body, runs, new_owner = shared_body, [], []

    def overtaken(amount):
        runs.append(amount)
        if len(runs) > 1:
            return real_body(amount)  # the new owner's run
        new_owner.extend(in_threads(1, lambda _: take_over()))
        Refund.objects.create(event_id="stale", amount=amount)
        return {"amount": amount, "run": "stale"}

    monkeypatch.setattr(f"{__name__}.shared_body", overtaken)
    answer = adapter(5)

    assert new_owner == [{"amount": 5, "run": 1}]
    assert answer == {"amount": 5, "run": 1}  # the new owner's, not its own
    assert Refund.objects.get().event_id == "run-1"  # the stale run kept nothing
    assert key_row(key="k").lease_version == 2
    assert adapter.outcomes == ["stored", "replayed"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("error", "left_to_its_lease"),
    [(OperationalError, True), (InterfaceError, True), (ProgrammingError, False)],
)
def test_a_view_and_a_task_release_their_key_on_one_rule(
    adapter, monkeypatch, error, left_to_its_lease
):
    # A key whose release meets an unavailable database is left to its lease, and the body's
    # own error stands; any other database error in the release is a fault, and surfaces.
    def release_fails(self, claim):
        raise error("release failed")

    def body_that_fails(amount):
        raise Boom(amount)

    monkeypatch.setattr(KeyStore, "fail", release_fails)
    monkeypatch.setattr(f"{__name__}.shared_body", body_that_fails)
    with pytest.raises(Boom if left_to_its_lease else error):
        adapter(5)
    assert key_row(key="k").state == "in_progress"
