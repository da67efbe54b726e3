"""Engine behaviour shared by both adapters: TTL, policies, signals and logs."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from django.db import transaction
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.core.engine import Engine, default_engine
from django_idempotency.core.keyed_request import handle
from django_idempotency.core.operation import Answer, Operation, Record, fit_scope
from django_idempotency.core.outcomes import Outcome
from django_idempotency.core.store import key_store
from django_idempotency.keys import ScopedKey
from django_idempotency.models import IdempotencyKey
from django_idempotency.policy import Policy
from tests.testapp.models import Payment

pytestmark = pytest.mark.django_db


@pytest.fixture
def clock(monkeypatch):
    """The default engine's clock, moved by ``clock.now += ...``."""

    class Clock:
        now = timezone.now()

        def __call__(self):
            return self.now

    fake = Clock()
    monkeypatch.setattr(default_engine, "clock", fake)
    return fake


class TestTTL:
    def test_a_key_past_its_ttl_is_absent_even_before_cleanup(self, client_alice, key, clock):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        clock.now += timedelta(hours=24, seconds=1)
        again = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

        assert again["Idempotency-Status"] == "stored"
        assert Payment.objects.count() == 2
        row = IdempotencyKey.objects.get()  # the expired row was taken over, not duplicated
        assert row.lease_version == 2
        assert row.replay_count == 0
        assert row.created_at == clock.now

    def test_a_key_within_its_ttl_replays(self, client_alice, key, clock):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        clock.now += timedelta(hours=23, minutes=59)
        again = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert again["Idempotency-Status"] == "replayed"

    def test_an_expired_key_may_carry_a_new_request(self, client_alice, key, clock):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        clock.now += timedelta(days=2)
        changed = client_alice.send("POST", "/payments/", {"amount": 2}, key=key)
        assert changed.status_code == 201

    @override_settings(IDEMPOTENCY={"TTL": 60})
    def test_ttl_setting_in_seconds(self, client_alice, key, clock):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        clock.now += timedelta(seconds=61)
        again = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert again["Idempotency-Status"] == "stored"


class TestPolicy:
    def test_defaults_come_from_settings(self):
        policy = Policy.from_settings()
        assert policy.header == "Idempotency-Key"
        assert policy.required is True
        assert policy.methods == {"POST", "PATCH", "DELETE"}
        assert policy.ttl == timedelta(hours=24)
        assert policy.retryable_status_codes == {408, 409, 425, 429}

    @override_settings(IDEMPOTENCY={"METHODS": ["post"], "TTL": timedelta(hours=1)})
    def test_settings_are_read_on_each_call(self):
        assert Policy.from_settings().methods == {"POST"}
        assert Policy.from_settings().ttl == timedelta(hours=1)

    @pytest.mark.parametrize(
        ("option", "value"),
        [
            ("methods", "POST"),
            ("methods", ["GET"]),
            ("fingerprint_headers", ["bad header"]),
            ("retryable_status_codes", [600]),
            ("wait_timeout", -1),
            ("ttl", 0),
            ("required", "yes"),
        ],
    )
    def test_bad_per_view_options_name_themselves(self, option, value):
        from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415

        with pytest.raises(ImproperlyConfigured, match=f"The view's {option} option"):
            Policy.from_settings(**{option: value})

    def test_an_unknown_option_is_a_type_error(self):
        with pytest.raises(TypeError, match="ttl_seconds"):
            Policy.from_settings(ttl_seconds=5)

    def test_overrides_win_and_none_keeps_the_setting(self):
        policy = Policy.from_settings(required=False, ttl=30, methods=None, wait_timeout=0)
        assert policy.required is False
        assert policy.ttl == timedelta(seconds=30)
        assert policy.methods == {"POST", "PATCH", "DELETE"}
        assert policy.wait_timeout == 0

    @pytest.mark.parametrize("status", [200, 201, 204, 301, 402, 403, 404, 410])
    def test_stored_statuses(self, status):
        assert Policy.from_settings().stores(status)

    @pytest.mark.parametrize("status", [400, 422, 408, 409, 425, 429, 500, 503, 599])
    def test_unstored_statuses(self, status):
        assert not Policy.from_settings().stores(status)


class TestEngineDirectly:
    def test_an_unresolved_request_is_scoped_by_its_path(self, key):
        request = RequestFactory().post("/direct/", b"{}", content_type="application/json")
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        response = handle(
            request,
            lambda: HttpResponse("ok", status=201),
            engine=Engine(),
            policy=Policy.from_settings(),
            sender=None,
        )
        assert response["Idempotency-Status"] == "stored"
        assert IdempotencyKey.objects.get().route == "/direct/"

    def test_a_transaction_marked_for_rollback_is_not_stored(self, key):
        def view():
            Payment.objects.create(amount=1)
            transaction.set_rollback(True)
            return HttpResponse("ok", status=201)

        request = RequestFactory().post("/direct/", b"{}", content_type="application/json")
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        response = handle(
            request, view, engine=Engine(), policy=Policy.from_settings(), sender=None
        )
        assert response.status_code == 201
        assert "Idempotency-Status" not in response
        assert (Payment.objects.count(), IdempotencyKey.objects.count()) == (0, 0)

    def test_the_clock_is_injectable(self, key):
        moment = timezone.now() - timedelta(days=3)
        request = RequestFactory().post("/direct/", b"{}", content_type="application/json")
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        handle(
            request,
            lambda: HttpResponse(status=201),
            engine=Engine(clock=lambda: moment),
            policy=Policy.from_settings(),
            sender=None,
        )
        assert IdempotencyKey.objects.get().created_at == moment


class TestSignalsAndLogs:
    @pytest.fixture
    def received(self):
        events = []

        def receiver(signal, sender, **kwargs):
            events.append((signal, sender, kwargs))

        all_signals = [
            signals.key_stored,
            signals.key_replayed,
            signals.payload_mismatch,
            signals.request_in_progress,
            signals.key_missing,
            signals.key_invalid,
            signals.response_not_stored,
            signals.database_unavailable,
        ]
        for signal in all_signals:
            signal.connect(receiver, weak=False)
        yield events
        for signal in all_signals:
            signal.disconnect(receiver)

    def test_each_decision_sends_its_signal(self, client_alice, key, received):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        client_alice.send("POST", "/payments/", {"amount": 2}, key=key)
        client_alice.send("POST", "/payments/", {"amount": 1})
        client_alice.send("POST", "/payments/", {"amount": 1}, key="bad key")
        client_alice.send("POST", "/payments/", {"amount": 1}, key="k", headers={"X-Status": "503"})

        assert [signal for signal, _, _ in received] == [
            signals.key_stored,
            signals.key_replayed,
            signals.payload_mismatch,
            signals.key_missing,
            signals.key_invalid,
            signals.response_not_stored,
        ]
        _, sender, stored = received[0]
        assert sender.__name__ == "PaymentView"
        assert stored["key"] == key
        assert stored["route"] == "payments/"
        assert stored["scope"] == f"auth.user:{client_alice.user.pk} POST payments/"
        assert stored["response"].status_code == 201
        assert stored["request"].user == client_alice.user

    def test_a_view_that_raises_is_reported_then_the_error_propagates(
        self, client_alice, key, received
    ):
        with pytest.raises(RuntimeError, match="boom"):
            client_alice.send(
                "POST", "/payments/", {"amount": 1}, key=key, headers={"X-Fail": "exception"}
            )
        ((signal, _, kwargs),) = received
        assert signal is signals.response_not_stored
        assert kwargs["key"] == key
        assert kwargs["response"] is None

    def test_each_decision_is_logged_with_structured_fields(self, client_alice, key, caplog):
        with caplog.at_level(logging.INFO, logger="django_idempotency"):
            client_alice.send("POST", "/payments/", {"amount": 4242}, key=key)
            client_alice.send("POST", "/payments/", {"amount": 4242}, key=key)

        stored, replayed = (r for r in caplog.records if r.name == "django_idempotency")
        assert stored.idempotency_outcome == Outcome.STORED
        assert replayed.idempotency_outcome == Outcome.REPLAYED
        assert replayed.idempotency_attempt == 2
        assert stored.idempotency_key == key
        assert stored.idempotency_route == "payments/"
        assert len(stored.idempotency_scope) == 16  # a hash, not the principal
        assert stored.idempotency_duration_ms >= 0
        assert stored.status_code == 201
        assert "4242" not in stored.getMessage()  # never the body


class TestCommittedInProgressRow:
    """A committed, unexpired row that is still in progress (as lease mode leaves one)."""

    @pytest.fixture
    def in_progress(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        row = IdempotencyKey.objects.get()
        IdempotencyKey.objects.filter(pk=row.pk).update(
            state=IdempotencyKey.State.IN_PROGRESS, response_body=None
        )
        return row

    def test_the_same_request_gets_409(self, client_alice, key, in_progress):
        busy = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert busy.status_code == 409
        assert busy["Retry-After"] == "1"

    def test_a_different_request_gets_422_first(self, client_alice, key, in_progress):
        assert client_alice.send("POST", "/payments/", {"amount": 2}, key=key).status_code == 422


def test_keys_that_differ_only_in_case_are_two_keys(client_alice):
    # MariaDB's default collations would make them one: its key columns compare bytes.
    for key in ("Order-1", "order-1"):
        response = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert response["Idempotency-Status"] == "stored"
    assert Payment.objects.count() == 2


def test_a_method_the_view_lacks_is_405_and_keeps_nothing(client_alice, key):
    response = client_alice.send("PUT", "/payments/", {"amount": 1}, key=key)
    assert response.status_code == 405
    assert IdempotencyKey.objects.count() == 0


def test_a_scope_longer_than_its_column_is_stored_as_its_digest(key):
    def long_scope(request, route):
        return "tenant:" + "x" * 600 + route

    def send():
        request = RequestFactory().post(
            "/" + "r" * 600 + "/", b"{}", content_type="application/json"
        )
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        policy = Policy.from_settings(scope_function=long_scope)
        return handle(
            request, lambda: HttpResponse(status=201), engine=Engine(), policy=policy, sender=None
        )

    first, second = send(), send()

    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    row = IdempotencyKey.objects.get()
    assert row.scope.startswith("sha256:")
    assert len(row.route) == 512


def test_a_failing_signal_receiver_does_not_undo_the_answer(client_alice, key, caplog):
    def broken(**kwargs):
        raise ValueError("receiver bug")

    signals.key_stored.connect(broken, weak=False)
    try:
        response = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    finally:
        signals.key_stored.disconnect(broken)
    assert response.status_code == 201
    assert response["Idempotency-Status"] == "stored"
    assert "receiver bug" in caplog.text


@override_settings(IDEMPOTENCY={"METHODS": "POST"})
def test_a_bad_setting_raises_instead_of_switching_the_library_off(client_alice, key):
    from django.core.exceptions import ImproperlyConfigured  # noqa: PLC0415

    with pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['METHODS'\].*E005"):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    assert Payment.objects.count() == 0


class CountingStore:
    """The default database's store, counting how often it is asked for a key."""

    def __init__(self):
        self.store, self.asked = key_store(IdempotencyKey, "default"), []

    def __getattr__(self, name):
        return getattr(self.store, name)

    def lookup(self, new):
        self.asked.append("lookup")
        return self.store.lookup(new)

    def acquire(self, new):
        self.asked.append("acquire")
        return self.store.acquire(new)

    def reserve(self, new):
        self.asked.append("reserve")
        return self.store.reserve(new)


@pytest.mark.django_db
def test_an_engine_asks_the_store_it_was_given_once_per_request(key):
    store = CountingStore()
    engine = Engine(store=store)

    def send():
        request = RequestFactory().post("/direct/", b"{}", content_type="application/json")
        request.META["HTTP_IDEMPOTENCY_KEY"] = key
        view = lambda: HttpResponse(status=201)  # noqa: E731
        return handle(request, view, engine=engine, policy=Policy.from_settings(), sender=None)

    # On PostgreSQL, the read that holds the key answers a replay too.
    read = [] if store.reserve_reads else ["lookup"]
    assert send()["Idempotency-Status"] == "stored"
    assert store.asked == [*read, "reserve"]
    assert send()["Idempotency-Status"] == "replayed"
    assert store.asked == [*read, "reserve", *(read or ["reserve"])]


class Greeting(Operation):
    """The smallest operation: no request, no task; its result is a string."""

    lease_in_transaction = "not in a transaction"

    def __init__(self, name, *, mode="atomic"):
        self.key = ScopedKey("greet-1", fit_scope("tests:greeting"))
        self.method, self.route, self.mode = "TEST", "greeting", mode
        self.fingerprint = name.ljust(64, "0")
        self.ttl, self.lease_timeout = timedelta(hours=1), timedelta(seconds=30)
        self.wait_timeout = 0.1
        self.name, self.runs = name, 0

    def run(self, attempt):
        self.runs += 1
        return f"hello {self.name}"

    def keeps(self, result):
        return True

    def encode(self, result):
        return Record(200, [], result.encode())

    def decode(self, stored):
        return stored.body.decode()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("mode", ["atomic", "lease"])
def test_the_engine_runs_any_operation_once_per_key(mode):
    first, again, other = Greeting("ada", mode=mode), Greeting("ada", mode=mode), Greeting("bob")

    assert Engine().run(first) == Answer(Outcome.STORED, "hello ada", 1)
    assert Engine().run(again) == Answer(Outcome.REPLAYED, "hello ada", 2)  # its second answer
    assert Engine().run(other) == Answer(Outcome.MISMATCH)
    assert (first.runs, again.runs, other.runs) == (1, 0, 0)
    row = IdempotencyKey.objects.get()
    assert (row.method, row.route, row.state, bytes(row.response_body)) == (
        "TEST",
        "greeting",
        "succeeded",
        b"hello ada",
    )
