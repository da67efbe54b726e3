"""Lease mode: the key commits first, a lease holds it, a dead request's lease is taken over."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from django_idempotency.core.engine import Engine
from django_idempotency.core.keyed_request import handle
from django_idempotency.core.rows import Conflict, NewKey
from django_idempotency.core.store import KeyStore, key_store
from django_idempotency.models import IdempotencyKey
from tests.conftest import ApiClient, process_env
from tests.factories import IdempotencyKeyFactory
from tests.test_store import leave_behind
from tests.testapp.models import Charge, Payment
from tests.testapp.views import LeasePaymentView, RecoveringLeasePaymentView, lock_wait_bound

ROOT = Path(__file__).resolve().parent.parent
# Leases are renewed from another thread, on a connection of its own: through PgBouncer too.
pytestmark = pytest.mark.pooled


class FrozenLeases:
    """A lease keeper that renews nothing, as in a process that is frozen while it runs."""

    def keep(self, store, claim, key, timeout):
        return contextlib.nullcontext()


@pytest.fixture(autouse=True)
def _forget_recoveries():
    RecoveringLeasePaymentView.recovered.clear()


def new_key(key, now, lease=timedelta(seconds=1), fingerprint="f" * 64):
    return NewKey(
        scope="s", key=key, method="POST", route="r/", fingerprint=fingerprint, now=now,
        expires_at=now + timedelta(hours=24), wait_timeout=1, locked_until=now + lease,
    )  # fmt: skip


def claim(store, key, now, lease=timedelta(seconds=1)):
    return store.claim(new_key(key, now, lease))


@pytest.mark.django_db(transaction=True)
class TestFencing:
    def test_a_stale_owner_can_neither_store_nor_release_after_a_takeover(self):
        store = key_store(IdempotencyKey, "default")
        now = timezone.now()
        first = claim(store, "k", now)
        assert claim(store, "k", now) is None  # the lease is live
        second = claim(store, "k", now + timedelta(seconds=2))  # the lease ran out

        assert (first.lease_version, second.lease_version) == (1, 2)
        assert second.attempts == 2
        stale = store.complete(first, status=201, headers=[], body=b"late", now=now)
        assert stale is False
        assert store.fail(first) is False
        row = IdempotencyKey.objects.get()
        assert (row.state, row.response_body) == (IdempotencyKey.State.IN_PROGRESS, None)
        assert store.complete(second, status=201, headers=[], body=b"ok", now=now) is True

    def test_a_lease_that_ran_out_is_not_taken_over_by_another_payload(self):
        # Its request may have had its effect: only a retry of that request may take it over.
        store = key_store(IdempotencyKey, "default")
        now = timezone.now()
        claim(store, "k", now)
        later = now + timedelta(seconds=2)
        changed = new_key("k", later, fingerprint="e" * 64)

        assert store.claim(changed) is None
        assert store.acquire(changed) == Conflict(fingerprint_matches=False)
        row = IdempotencyKey.objects.get()
        assert (row.state, row.lease_version, row.attempts) == ("in_progress", 1, 1)
        assert store.acquire(new_key("k", later)).lease_version == 2  # the same payload may

    def test_a_completed_key_is_not_taken_over_until_it_expires(self):
        store = key_store(IdempotencyKey, "default")
        now = timezone.now()
        first = claim(store, "k", now)
        store.complete(first, status=201, headers=[], body=b"ok", now=now)
        assert claim(store, "k", now + timedelta(hours=1)) is None
        fresh = claim(store, "k", now + timedelta(hours=25))
        assert (fresh.lease_version, fresh.attempts) == (2, 1)  # expired: a fresh start


@pytest.mark.django_db(transaction=True)
class TestLeaseRequests:
    def test_the_first_request_commits_its_key_and_stores_its_answer(self, client_alice, key):
        first = client_alice.send("POST", "/lease/", {"amount": 5}, key=key)
        second = client_alice.send("POST", "/lease/", {"amount": 5}, key=key)
        assert first["Idempotency-Status"] == "stored"
        assert second["Idempotency-Status"] == "replayed"
        assert second.content == first.content
        row = IdempotencyKey.objects.get()
        assert (row.state, row.locked_until, row.attempts) == ("succeeded", None, 1)
        assert Payment.objects.count() == 1

    def test_a_failed_request_releases_its_key_and_the_retry_recovers(self, client_alice, key):
        client = ApiClient(client_alice.user, raise_request_exception=False)
        failed = client.send(
            "POST", "/lease-recovering/", {"amount": 5}, key=key, headers={"X-Fail": "exception"}
        )
        assert failed.status_code == 500
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.FAILED

        assert Payment.objects.count() == 0  # the failed request's writes were rolled back

        retry = client.send("POST", "/lease-recovering/", {"amount": 5}, key=key)
        # The provider had charged before the error: the hook found the charge and recorded
        # it, and the card was not charged again.
        assert retry["Idempotency-Status"] == "stored"
        assert RecoveringLeasePaymentView.recovered == [(key, 2)]
        assert Charge.objects.get().calls == 1
        assert Payment.objects.count() == 1
        assert json.loads(retry.content)["id"] == Payment.objects.get().pk

    def test_without_a_recovery_hook_the_retry_runs_again(self, client_alice, key):
        client_alice.send("POST", "/lease/", {"amount": 5}, key=key, headers={"X-Status": "503"})
        retry = client_alice.send("POST", "/lease/", {"amount": 5}, key=key)
        assert retry["Idempotency-Status"] == "stored"
        assert IdempotencyKey.objects.get().attempts == 2
        assert Charge.objects.get().calls == 2  # the view ran again
        assert Payment.objects.count() == 1  # the 503's own record was rolled back

    def test_lease_mode_refuses_to_run_inside_a_transaction(self, client_alice, key, monkeypatch):
        monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
        with pytest.raises(ImproperlyConfigured, match="non_atomic_requests"):
            client_alice.send("POST", "/lease/", {"amount": 5}, key=key)
        assert IdempotencyKey.objects.count() == 0


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("found", ["nothing", "expired", "failed", "lease ran out"])
def test_a_lease_mode_view_runs_under_the_sessions_own_lock_wait(client_alice, key, found):
    # The claim commits before the view runs; a takeover's claim must not bound the view either.
    session = lock_wait_bound()
    if found != "nothing":
        client_alice.send("POST", "/lease-lock-wait/", {}, key=key)
        leave_behind(found)

    response = client_alice.send("POST", "/lease-lock-wait/", {}, key=key)

    assert response["Idempotency-Status"] == "stored"
    assert json.loads(response.content)["lock_wait"] == session
    assert IdempotencyKey.objects.get().lease_version == (1 if found == "nothing" else 2)


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
class TestLeaseConcurrency:
    def start(self, work):
        from tests.test_store import start  # noqa: PLC0415

        return start(work)

    def wait_for(self, condition, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.02)
        raise AssertionError("timed out")

    def test_the_claim_is_committed_while_the_view_runs(self, alice, key):
        first = self.start(
            lambda: ApiClient(alice).send(
                "POST", "/lease/", {"amount": 5}, key=key, headers={"X-Hold": "0.5"}
            )
        )
        self.wait_for(lambda: IdempotencyKey.objects.filter(key=key).exists())
        row = IdempotencyKey.objects.get()
        assert row.state == IdempotencyKey.State.IN_PROGRESS
        assert row.locked_until > timezone.now()
        assert first()["Idempotency-Status"] == "stored"

    @override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 5})
    def test_a_duplicate_waits_for_the_lease_holder_and_replays(self, alice, key):
        first = self.start(
            lambda: ApiClient(alice).send(
                "POST", "/lease/", {"amount": 5}, key=key, headers={"X-Hold": "0.5"}
            )
        )
        self.wait_for(lambda: IdempotencyKey.objects.filter(key=key).exists())
        duplicate = ApiClient(alice).send("POST", "/lease/", {"amount": 5}, key=key)
        assert duplicate["Idempotency-Status"] == "replayed"
        assert duplicate.content == first().content
        assert Payment.objects.count() == 1

    @override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.2})
    def test_past_the_wait_a_duplicate_gets_409_and_a_changed_one_422(self, alice, key):
        first = self.start(
            lambda: ApiClient(alice).send(
                "POST", "/lease/", {"amount": 5}, key=key, headers={"X-Hold": "0.8"}
            )
        )
        self.wait_for(lambda: IdempotencyKey.objects.filter(key=key).exists())
        busy = ApiClient(alice).send("POST", "/lease/", {"amount": 5}, key=key)
        changed = ApiClient(alice).send("POST", "/lease/", {"amount": 6}, key=key)
        first()
        assert busy.status_code == 409
        # The claim is committed, so a different request is told apart at once.
        assert changed.status_code == 422
        assert Payment.objects.count() == 1

    def test_a_killed_worker_is_recovered_after_its_lease_runs_out(self, alice, key):
        env = process_env()
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.lease_worker", alice.username, key], cwd=ROOT, env=env
        )
        try:
            # Killed mid-effect: the provider charged, the payment is not recorded.
            self.wait_for(lambda: Charge.objects.filter(key=key, calls=1).exists(), timeout=30)
            worker.send_signal(signal.SIGKILL)
            worker.wait(timeout=10)
        finally:
            worker.kill()

        client = ApiClient(alice)
        with override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.1}):
            during = client.send("POST", "/lease-recovering/", {"amount": 700}, key=key)
        assert during.status_code == 409  # the dead worker's lease still holds
        time.sleep(1.1)  # the view's lease is one second
        retry = client.send("POST", "/lease-recovering/", {"amount": 700}, key=key)
        again = client.send("POST", "/lease-recovering/", {"amount": 700}, key=key)

        assert retry["Idempotency-Status"] == "stored"
        assert again["Idempotency-Status"] == "replayed"
        assert RecoveringLeasePaymentView.recovered == [(key, 2)]
        assert Payment.objects.filter(reference=key).count() == 1
        assert Charge.objects.get(key=key).calls == 1

    @override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.2})
    @pytest.mark.parametrize("slow", ["X-Delay", "X-Hold", "X-Hold-Recorded"])
    def test_a_live_request_slower_than_its_lease_keeps_its_key(self, alice, key, slow, caplog):
        # The view's lease is one second; the request takes four, before or after the provider
        # charges. While it runs, its retries (about one and two seconds in, well before it
        # ends however loaded the machine) are told to wait.
        first = self.start(
            lambda: ApiClient(alice).send(
                "POST", "/lease-recovering/", {"amount": 5}, key=key, headers={slow: "4"}
            )
        )
        retries = []
        for _ in range(2):
            time.sleep(1.0)
            retries.append(
                ApiClient(alice).send("POST", "/lease-recovering/", {"amount": 5}, key=key)
            )
        answer = first()

        assert [retry.status_code for retry in retries] == [409, 409]
        assert (answer.status_code, answer["Idempotency-Status"]) == (201, "stored")
        assert RecoveringLeasePaymentView.recovered == []
        assert Charge.objects.get().calls == 1
        assert Payment.objects.count() == 1
        assert "longer than its 1 s lease" in caplog.text  # said once, by the lease keeper
        assert caplog.text.count("longer than its") == 1

    def test_a_lease_that_ran_out_refuses_a_retry_with_another_payload(
        self, alice, key, monkeypatch
    ):
        # The first request may have charged 5: a request for 7 with its key is refused, as
        # any other mismatch is, and the first request keeps its key and stores its answer.
        monkeypatch.setattr(LeasePaymentView, "idempotency_engine", Engine(leases=FrozenLeases()))
        first = self.start(
            lambda: ApiClient(alice).send(
                "POST", "/lease-recovering/", {"amount": 5}, key=key, headers={"X-Delay": "2"}
            )
        )
        time.sleep(1.3)
        changed = ApiClient(alice).send("POST", "/lease-recovering/", {"amount": 7}, key=key)
        answer = first()

        assert changed.status_code == 422
        assert json.loads(changed.content)["code"] == "idempotency.payload_mismatch"
        assert (answer.status_code, answer["Idempotency-Status"]) == (201, "stored")
        assert RecoveringLeasePaymentView.recovered == []
        assert Charge.objects.get().calls == 1
        assert Payment.objects.get().amount == 5
        row = IdempotencyKey.objects.get()
        assert (row.state, row.lease_version, row.attempts) == ("succeeded", 1, 1)

    @override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 5})
    @pytest.mark.parametrize("slow", ["X-Delay", "X-Hold", "X-Hold-Recorded"])
    def test_a_request_that_lost_its_lease_keeps_nothing_and_answers_as_the_new_owner(
        self, alice, key, slow, monkeypatch
    ):
        # A frozen process (a long pause, a suspended VM) renews nothing: its lease runs out,
        # and the retry takes the key over and recovers the charge. When the first request
        # resumes, its own writes are rolled back and it answers with the retry's result.
        monkeypatch.setattr(LeasePaymentView, "idempotency_engine", Engine(leases=FrozenLeases()))
        first = self.start(
            lambda: ApiClient(alice).send(
                "POST", "/lease-recovering/", {"amount": 5}, key=key, headers={slow: "2"}
            )
        )
        time.sleep(1.3)
        retry = ApiClient(alice).send("POST", "/lease-recovering/", {"amount": 5}, key=key)
        answer = first()

        payment = Payment.objects.get()
        assert (retry.status_code, retry["Idempotency-Status"]) == (201, "stored")
        assert json.loads(retry.content) == {"id": payment.pk}
        assert (answer.status_code, answer["Idempotency-Status"]) == (201, "replayed")
        assert answer.content == retry.content
        assert Charge.objects.get().key == key  # one charge at the provider
        row = IdempotencyKey.objects.get()
        assert (row.state, row.lease_version, row.attempts) == ("succeeded", 2, 2)

    def test_parallel_sweepers_take_each_expired_lease_once(self):
        columns = (
            "INSERT INTO django_idempotency_idempotencykey (scope, {key}, method, route, "
            "fingerprint, state, lease_version, locked_until, attempts, created_at, "
            "expires_at, replay_count) "
        )
        if connection.vendor == "mysql":
            sql = columns.format(key="`key`") + (  # noqa: S608 - constants
                "SELECT 's', CONCAT('k', seq), 'POST', 'r/', %s, 'in_progress', 1, "
                "UTC_TIMESTAMP(6) - INTERVAL 1 SECOND, 1, UTC_TIMESTAMP(6), "
                "UTC_TIMESTAMP(6) + INTERVAL 1 DAY, 0 FROM seq_1_to_10000"
            )
        else:
            sql = columns.format(key="key") + (
                "SELECT 's', 'k' || n, 'POST', 'r/', %s, 'in_progress', 1, "
                "now() - interval '1 second', 1, now(), now() + interval '1 day', 0 "
                "FROM generate_series(1, 10000) AS n"
            )
        with connection.cursor() as cursor:
            cursor.execute(sql, ["f" * 64])
        from tests.test_store import in_threads  # noqa: PLC0415

        swept = in_threads(4, lambda _: IdempotencyKey.objects.sweep_expired_leases(batch_size=500))
        assert sum(swept) == 10_000
        assert IdempotencyKey.objects.filter(state="failed", lease_version=2).count() == 10_000
        assert not IdempotencyKey.objects.filter(locked_until__isnull=False).exists()


@pytest.mark.django_db(transaction=True)
class TestLeaseEdges:
    def post(self, view, engine=None, key="k"):
        from django.http import HttpResponse  # noqa: PLC0415
        from django.test import RequestFactory  # noqa: PLC0415

        from django_idempotency.core.engine import Engine  # noqa: PLC0415
        from django_idempotency.policy import Policy  # noqa: PLC0415

        request = RequestFactory().post("/lease-direct/", b"{}", content_type="application/json")
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        policy = Policy.from_settings(mode="lease", lease_timeout=1)
        return handle(
            request,
            lambda: view() or HttpResponse(status=201),
            engine=engine or Engine(),
            policy=policy,
            sender=None,
        )

    def test_a_key_that_cannot_be_released_is_left_to_its_lease(self, caplog, monkeypatch):
        from django.db import OperationalError  # noqa: PLC0415

        def broken_fail(self, claim):
            raise OperationalError("connection lost")

        monkeypatch.setattr(KeyStore, "fail", broken_fail)

        def failing_view():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            self.post(failing_view)
        assert "its lease will run out" in caplog.text
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.IN_PROGRESS


@pytest.mark.django_db
def test_the_sweep_command_and_task():
    from io import StringIO  # noqa: PLC0415

    from django.core.management import call_command  # noqa: PLC0415

    from django_idempotency.tasks import sweep_expired_leases  # noqa: PLC0415

    IdempotencyKeyFactory.create_batch(3, lease_expired=True)
    out = StringIO()
    call_command("idempotency_sweep", stdout=out)
    assert out.getvalue().strip() == "Swept 3 expired leases."
    assert set(IdempotencyKey.objects.values_list("state", "lease_version")) == {("failed", 2)}
    IdempotencyKeyFactory(lease_expired=True)
    assert sweep_expired_leases.apply().get() == 1
