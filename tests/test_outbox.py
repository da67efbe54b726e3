"""The transactional outbox: published with the transaction, relayed at least once, in order."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from celery import current_app
from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler
from django.core.management import call_command
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.db import OperationalError, transaction
from django.test import override_settings
from django.utils import timezone

from django_idempotency import guard, signals, tasks
from django_idempotency.backoff import exponential_bound
from django_idempotency.exceptions import PermanentError
from django_idempotency.models import InboxEvent, OutboxMessage
from django_idempotency.outbox import (
    ANY_TOPIC,
    CeleryTaskDispatcher,
    DispatchError,
    WebhookDispatcher,
    outbox_dispatcher,
    publish,
    redeliver,
    register_dispatcher,
    relay,
)
from django_idempotency.outbox import relaying as outbox_relay
from django_idempotency.outbox.dispatchers import get_dispatcher, unregister
from django_idempotency.signing import StandardWebhooksSignature
from tests.conftest import process_env, start_command, stop_commands
from tests.factories import OutboxMessageFactory
from tests.test_store import in_threads
from tests.testapp import outbox as test_outbox
from tests.testapp.models import Refund

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
BASE = 30.0


@pytest.fixture(autouse=True)
def recorded():
    test_outbox.RECORDED.clear()
    yield test_outbox.RECORDED
    test_outbox.RECORDED.clear()


@pytest.fixture
def periodic_only(monkeypatch):
    """No relay after commit: only the test's own calls relay."""
    monkeypatch.setattr(outbox_relay, "trigger", lambda: None)


def later(seconds):
    return lambda: timezone.now() + timedelta(seconds=seconds)


def publish_then_roll_back():
    with transaction.atomic():
        publish("tests.recorded", {"n": 1})
        raise RuntimeError


def test_a_rolled_back_transaction_publishes_nothing_and_a_commit_exactly_once(recorded):
    with pytest.raises(RuntimeError):
        publish_then_roll_back()
    assert not OutboxMessage.objects.exists()
    assert recorded == []

    with transaction.atomic():
        message = publish("tests.recorded", {"n": 2})
        assert recorded == []  # not before the commit

    assert recorded == [str(message.message_id)]
    message.refresh_from_db()
    assert (message.status, message.attempts) == ("dispatched", 1)
    assert message.dispatched_at is not None
    assert message.next_attempt_at is None


def test_one_transaction_triggers_one_relay_for_all_its_messages(monkeypatch, recorded):
    runs = []
    real = outbox_relay.relay
    monkeypatch.setattr(outbox_relay, "relay", lambda **kw: runs.append(kw) or real(**kw))

    with transaction.atomic():
        for n in range(5):
            publish("tests.recorded", {"n": n})

    assert len(runs) == 1
    assert len(recorded) == 5


def test_a_failing_dispatch_is_retried_with_full_jitter_then_dead(periodic_only, recorded):
    with override_settings(IDEMPOTENCY={"OUTBOX_MAX_ATTEMPTS": 3}):
        message = publish("tests.failing", {"fail_times": "always"})
        for attempt in range(1, 4):
            started = timezone.now()
            result = relay(now=later(BASE * 2**attempt))
            message.refresh_from_db()
            assert message.attempts == attempt
            if attempt < 3:
                assert (result.failed, message.status) == (1, "pending")
                delay = (message.next_attempt_at - started).total_seconds() - BASE * 2**attempt
                assert 0 <= delay <= exponential_bound(attempt, BASE, 6 * 3600) + 1
        assert (result.dead, message.status) == (1, "dead")
        assert message.next_attempt_at is None
        assert message.last_error == "ConnectionError: the consumer is down (attempt 3)"
        assert relay(now=later(10**6)).batches == 0  # dead: never relayed again

    # The consumer is back: an operator redelivers.
    OutboxMessage.objects.update(payload={})
    assert redeliver(OutboxMessage.objects.all()) == [message.pk]
    relay()
    message.refresh_from_db()
    assert (message.status, message.attempts) == ("dispatched", 1)
    assert recorded == [str(message.message_id)]


def test_a_message_is_not_retried_before_its_time(periodic_only, recorded):
    message = publish("tests.failing", {"fail_times": 1})
    relay(random=lambda: 0.5)  # fails; the retry is due in 15 s
    assert relay().batches == 0

    again = relay(now=later(BASE / 2 + 1))
    message.refresh_from_db()
    seen = (again, message.status, message.attempts, message.last_error, recorded)
    assert (again.dispatched, len(recorded)) == (1, 1), seen


def test_a_message_delivered_after_a_failure_keeps_the_failure_s_error(periodic_only, recorded):
    failed = publish("tests.failing", {"fail_times": 1})
    clean = publish("tests.recorded", {})
    relay()

    assert relay(now=later(10**6)).dispatched == 1

    failed.refresh_from_db()
    clean.refresh_from_db()
    assert (failed.status, failed.attempts) == ("dispatched", 2)
    assert failed.last_error == "ConnectionError: the consumer is down (attempt 1)"
    assert (clean.status, clean.last_error) == ("dispatched", "")


def test_a_topic_without_a_dispatcher_is_retried_not_lost(periodic_only):
    publish("tests.nobody", {})

    result = relay()

    message = OutboxMessage.objects.get()
    assert (result.failed, message.status) == (1, "pending")
    assert message.last_error == (
        "LookupError: No outbox dispatcher is registered for the topic 'tests.nobody'."
    )


def test_messages_with_an_ordering_key_leave_one_at_a_time_in_order(periodic_only, recorded):
    first = publish("tests.failing", {"fail_times": 1}, ordering_key="payment-1")
    second = publish("tests.recorded", {}, ordering_key="payment-1")
    third = publish("tests.recorded", {}, ordering_key="payment-1")
    other = publish("tests.recorded", {}, ordering_key="payment-2")
    unordered = publish("tests.recorded", {})

    relay()
    # The first failed: the ones behind it wait for it; other keys do not.
    assert recorded == [str(other.message_id), str(unordered.message_id)]

    relay(now=later(BASE + 1))
    assert recorded[2:] == [str(m.message_id) for m in (first, second, third)]


class Together:
    """A dispatcher that sends a batch's messages at once: the even ``n`` are delivered."""

    def __init__(self, answer=None):
        self.batches = []
        self.answer = answer

    def __call__(self, message):
        raise AssertionError("the relay hands dispatch_many the batch")

    def dispatch_many(self, messages):
        self.batches.append([message.payload["n"] for message in messages])
        if self.answer is not None:
            return self.answer(messages)
        return [None if m.payload["n"] % 2 == 0 else DispatchError("odd") for m in messages]


@pytest.fixture
def together():
    made = []

    def register(answer=None):
        made.append(Together(answer))
        for topic in ("tests.together", "tests.together.too"):
            register_dispatcher(topic, made[-1])
        return made[-1]

    yield register
    unregister("tests.together", "tests.together.too")


def test_a_dispatcher_that_dispatches_many_gets_its_batch_at_once_and_answers_for_each(
    periodic_only, recorded, together
):
    dispatcher = together()
    topics = ["tests.together", "tests.recorded", "tests.together.too", "tests.together"]
    messages = [publish(topic, {"n": n}) for n, topic in enumerate(topics)]

    result = relay(batch_size=10)

    # Its three messages in one call; the plain dispatcher's one alone, as ever.
    assert dispatcher.batches == [[0, 2, 3]]
    assert recorded == [str(messages[1].message_id)]
    assert (result.dispatched, result.failed) == (3, 1)
    for message in messages:
        message.refresh_from_db()
    assert [(m.status, m.last_error) for m in messages] == [
        ("dispatched", ""),
        ("dispatched", ""),
        ("dispatched", ""),
        ("pending", "DispatchError: odd"),
    ]


def refuse(messages):
    raise DispatchError("the broker is gone")


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (refuse, "DispatchError: the broker is gone"),
        (lambda messages: [None], "TypeError: "),
        (lambda messages: [True] * len(messages), "DispatchError: True"),
    ],
    ids=["raises", "answers-for-fewer", "answers-not-none"],
)
def test_no_message_is_marked_sent_that_dispatch_many_did_not_answer_none_for(
    periodic_only, together, answer, error
):
    together(answer)
    for n in range(3):
        publish("tests.together", {"n": n})

    result = relay()

    assert (result.dispatched, result.failed) == (0, 3)
    for message in OutboxMessage.objects.all():
        assert message.status == "pending"
        assert message.last_error.startswith(error), message.last_error


def test_a_relay_asked_to_stop_gives_back_what_it_has_not_handed_to_dispatch_many(
    periodic_only, recorded, together
):
    dispatcher = together()
    publish("tests.recorded", {})
    publish("tests.together", {"n": 0})
    # Asked before the claim, then before each dispatch: it answers True at the second.
    answers = iter([False, False])

    result = relay(stop=lambda: next(answers, True))

    assert (result.dispatched, result.complete) == (1, False)
    assert dispatcher.batches == []
    back = OutboxMessage.objects.get(topic="tests.together")
    assert (back.status, back.attempts) == ("pending", 0)


def test_purge_deletes_old_dispatched_messages_and_never_an_unsent_one(periodic_only):
    year_ago = timezone.now() - timedelta(days=365)
    OutboxMessageFactory(created_at=year_ago)
    OutboxMessageFactory(created_at=year_ago, dead=True)
    OutboxMessageFactory(created_at=year_ago, sent=True)
    OutboxMessageFactory(created_at=year_ago, sent=True, dispatched_at=timezone.now())

    purged = tasks.purge_dispatched_outbox_messages()

    assert purged == 1
    remaining = OutboxMessage.objects.order_by("pk").values_list("status", flat=True)
    assert list(remaining) == ["pending", "dead", "dispatched"]


def test_the_task_and_the_command_relay(periodic_only, recorded):
    publish("tests.recorded", {})
    assert tasks.relay_outbox() == 1

    publish("tests.recorded", {})
    out = run_command("idempotency_outbox", "--no-purge")
    assert out == ["Dispatched 1 outbox messages (0 to retry, 0 dead)."]
    assert run_command("idempotency_outbox") == [
        "Dispatched 0 outbox messages (0 to retry, 0 dead).",
        "Purged 0 dispatched outbox messages.",
    ]
    assert len(recorded) == 2


def test_a_relay_stops_at_its_time_limit(periodic_only, recorded):
    publish("tests.recorded", {})

    result = relay(max_seconds=0)

    assert (result.batches, result.complete) == (0, False)
    assert recorded == []


@override_settings(IDEMPOTENCY={"OUTBOX_RUNNER": "celery"})
def test_with_celery_the_commit_asks_a_worker_to_relay(monkeypatch, caplog):
    asked = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args: asked.append((name, args)))
    with transaction.atomic():
        publish("tests.recorded", {})
        publish("tests.recorded", {})
    assert asked == [("django_idempotency.relay_outbox", ())]

    def unreachable(name, args):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(current_app, "send_task", unreachable)
    publish("tests.recorded", {})
    assert "could not ask Celery to relay the outbox" in caplog.text
    assert OutboxMessage.objects.filter(status="pending").count() == 3


def test_dispatchers_register_per_topic_with_a_fallback():
    @outbox_dispatcher("a.b", "c.d")
    def specific(message):
        pass

    try:
        assert get_dispatcher("a.b") is specific
        assert get_dispatcher("c.d") is specific
        assert get_dispatcher("x.y") is None
        register_dispatcher(ANY_TOPIC, specific)
        assert get_dispatcher("x.y") is specific
        register_dispatcher("a.b", specific)  # the same again is no conflict
        with pytest.raises(Exception, match="has a dispatcher already"):
            register_dispatcher("a.b", print)
        with pytest.raises(TypeError):
            outbox_dispatcher()
    finally:
        unregister("a.b", "c.d", ANY_TOPIC)


def test_the_celery_task_dispatcher_sends_the_message_id_as_the_task_id(monkeypatch):
    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, **kw: sent.append((name, kw)))
    message = OutboxMessageFactory.build(topic="t", payload={"a": 1})

    CeleryTaskDispatcher("billing.handle", queue="billing")(message)

    assert sent == [
        (
            "billing.handle",
            {
                "kwargs": {"payload": {"a": 1}, "message_id": str(message.message_id)},
                "task_id": str(message.message_id),
                "queue": "billing",
            },
        )
    ]
    assert repr(CeleryTaskDispatcher("x")) == "CeleryTaskDispatcher('x')"


def test_the_celery_task_dispatcher_sends_the_message_s_correlation_id(monkeypatch):
    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, **kw: sent.append(kw))
    message = OutboxMessageFactory.build(headers={"X-Correlation-ID": "corr-7"})

    CeleryTaskDispatcher("billing.handle")(message)

    assert sent[0]["headers"] == {"X-Correlation-ID": "corr-7"}


# Over HTTP: the webhook dispatcher, and the test app's inbox behind a real server.


@pytest.fixture
def server():
    """The test app served over HTTP on loopback, in this process."""
    httpd = ThreadedWSGIServer(("127.0.0.1", 0), _QuietHandler, allow_reuse_address=False)
    httpd.set_app(WSGIHandler())
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def to_inbox(server):
    dispatcher = WebhookDispatcher(f"{server}/webhooks/outbox/", settings.TEST_WEBHOOK_SECRETS)
    register_dispatcher("payment.captured", dispatcher)
    yield dispatcher
    unregister("payment.captured")


def test_a_message_goes_over_http_to_an_inbox_that_processes_it_once(to_inbox):
    with transaction.atomic():
        message = publish("payment.captured", {"amount": 4200}, headers={"X-Tenant": "acme"})

    message.refresh_from_db()
    assert message.status == "dispatched"
    event = InboxEvent.objects.get()
    assert (event.source, event.event_id, event.event_type) == (
        "outbox",
        str(message.message_id),
        "payment.captured",
    )
    assert event.payload["data"] == {"amount": 4200}
    assert list(Refund.objects.values_list("event_id", "amount")) == [
        (str(message.message_id), 4200)
    ]
    # Sent again (as after a relay died before marking it): a duplicate, processed once.
    redeliver(OutboxMessage.objects.all())
    assert InboxEvent.objects.count() == 1
    assert Refund.objects.count() == 1


def test_the_webhook_is_signed_and_carries_the_message_id(server, monkeypatch):
    seen = []
    monkeypatch.setattr(
        WebhookDispatcher, "client", property(lambda self: _Recorder(seen)), raising=True
    )
    message = OutboxMessageFactory.build(
        topic="payment.captured", payload={"amount": 1}, headers={"X-A": "b"}
    )

    WebhookDispatcher(lambda: f"{server}/hook/", ["whsec_dGVzdA=="])(message)

    ((url, body, headers),) = seen
    assert url == f"{server}/hook/"
    assert json.loads(body)["id"] == str(message.message_id)
    assert headers["Idempotency-Key"] == headers["webhook-id"] == str(message.message_id)
    assert headers["X-A"] == "b"
    StandardWebhooksSignature(["whsec_dGVzdA=="]).verify(headers, body)


def test_a_webhook_refused_with_a_4xx_is_dead_at_once(server, periodic_only):
    # A wrong secret: the inbox answers 400, and would answer it to every retry.
    dispatcher = WebhookDispatcher(f"{server}/webhooks/outbox/", ["whsec_d3Jvbmc="])
    register_dispatcher("payment.captured", dispatcher)
    try:
        publish("payment.captured", {"amount": 1})
        relay()
    finally:
        unregister("payment.captured")

    message = OutboxMessage.objects.get()
    assert (message.status, message.attempts) == ("dead", 1)
    assert message.last_error == (f"PermanentDispatchError: {server}/webhooks/outbox/ answered 400")
    assert repr(dispatcher) == f"WebhookDispatcher('{server}/webhooks/outbox/')"


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 503])
def test_a_webhook_answered_with_a_retryable_status_is_retried(periodic_only, monkeypatch, status):
    monkeypatch.setattr(
        WebhookDispatcher, "client", property(lambda self: _Recorder([], status)), raising=True
    )
    register_dispatcher("payment.captured", WebhookDispatcher("http://consumer/", ["whsec_eA=="]))
    try:
        publish("payment.captured", {"amount": 1})
        relay()
    finally:
        unregister("payment.captured")

    message = OutboxMessage.objects.get()
    assert (message.status, message.attempts) == ("pending", 1)
    assert message.last_error == f"DispatchError: http://consumer/ answered {status}"


def test_a_dispatcher_that_raises_a_permanent_error_makes_the_message_dead(periodic_only):
    def refuse(message):
        raise PermanentError("the consumer no longer takes this topic")

    register_dispatcher("payment.captured", refuse)
    try:
        publish("payment.captured", {"amount": 1})
        relay()
    finally:
        unregister("payment.captured")

    message = OutboxMessage.objects.get()
    assert (message.status, message.attempts, message.next_attempt_at) == ("dead", 1, None)
    assert message.last_error == "PermanentError: the consumer no longer takes this topic"


def test_a_dispatcher_is_told_the_time_its_relay_has_left(periodic_only):
    told = []
    register_dispatcher("tests.timed", lambda message: told.append(guard.remaining()))
    try:
        publish("tests.timed", {})
        relay(max_seconds=5)
        publish("tests.timed", {})
        relay()
        # Run for a request whose caller waits two seconds more (Request-Timeout-Ms: 2000).
        publish("tests.timed", {})
        with guard.inbound(guard.from_headers({guard.TIMEOUT_HEADER: "2000"})):
            relay(max_seconds=5)
    finally:
        unregister("tests.timed")

    bounded, unbounded, for_a_caller = told
    assert 0 < bounded <= 5
    assert unbounded is None
    assert 0 < for_a_caller <= 2


def test_a_webhook_that_does_not_answer_holds_the_relay_no_longer_than_its_time(periodic_only):
    # The kernel accepts the connections; nobody reads the requests or answers them.
    with socket.create_server(("127.0.0.1", 0), backlog=16) as silent:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/hook/"
        register_dispatcher("payment.captured", WebhookDispatcher(url, ["whsec_dGVzdA=="]))
        try:
            message = publish("payment.captured", {"amount": 1})
            started = time.monotonic()
            result = relay(max_seconds=1)
            seconds = time.monotonic() - started
        finally:
            unregister("payment.captured")

    # The dispatcher's own timeout (10 s a request, 30 s with its retries) was cut to the
    # relay's second; the message is given back, its attempt not counted.
    assert seconds < 3
    assert (result.dispatched, result.failed, result.complete) == (0, 0, False)
    message.refresh_from_db()
    assert (message.status, message.attempts, message.last_error) == ("pending", 0, "")


class _Recorder:
    def __init__(self, seen, status=200):
        self.seen, self.status = seen, status

    def post(self, url, *, content, headers):
        self.seen.append((url, content, headers))
        return _Answer(self.status)


class _Answer:
    def __init__(self, status):
        self.status_code, self.is_success = status, 200 <= status < 300


def run_command(*args):
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue().splitlines()


# PostgreSQL: several relays at once, and relays killed mid-batch.


@pytest.mark.server_db
def test_three_relays_at_once_over_ten_thousand_messages_send_each_exactly_once(
    periodic_only, recorded
):
    OutboxMessage.objects.bulk_create(OutboxMessageFactory.build_batch(10_000))

    results = in_threads(3, lambda _: relay(batch_size=100))

    assert sum(result.dispatched for result in results) == 10_000
    assert all(result.dispatched > 0 for result in results)  # they shared the work
    counts = Counter(recorded)
    assert len(counts) == 10_000
    assert set(counts.values()) == {1}
    assert not OutboxMessage.objects.exclude(status="dispatched").exists()


@pytest.mark.server_db
def test_concurrent_relays_keep_each_ordering_key_in_order(periodic_only, recorded):
    OutboxMessage.objects.bulk_create(
        OutboxMessageFactory.build(ordering_key=f"key-{n % 10}") for n in range(500)
    )
    order = {str(m.message_id): (m.ordering_key, m.pk) for m in OutboxMessage.objects.all()}

    in_threads(3, lambda _: relay(batch_size=7))

    assert len(recorded) == 500
    for key in {key for key, _pk in order.values()}:
        sent = [order[message_id][1] for message_id in recorded if order[message_id][0] == key]
        assert sent == sorted(sent), key


@pytest.mark.server_db
def test_relays_killed_mid_batch_deliver_every_message_and_the_inbox_processes_each_once(
    server, periodic_only
):
    messages = 300
    with transaction.atomic():
        for n in range(messages):
            publish("payment.captured", {"amount": n})
    duplicates = []

    def on_duplicate(**kwargs):
        duplicates.append(1)

    signals.inbox_event_duplicate.connect(on_duplicate)
    env = process_env(
        TEST_OUTBOX_URL=f"{server}/webhooks/outbox/",
        DJANGO_SETTINGS_MODULE="tests.settings",
        # On a loaded machine a relay may be killed in its first batch ten times over: its
        # messages would end dead, as they should, but this test is about the ones sent.
        TEST_OUTBOX_MAX_ATTEMPTS="1000",
    )
    relay_once = [
        sys.executable,
        "-m",
        "django",
        "idempotency_outbox",
        "--batch-size",
        "20",
        # A killed relay's batch is due again a second later.
        "--lease",
        "1",
    ]
    command = [*relay_once, "--forever", "--interval", "0.2"]
    try:
        kills = 0
        while OutboxMessage.objects.filter(status="pending").exists() and kills < 30:
            relay_process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, start_new_session=True
            )
            time.sleep(1.5 if kills < 5 else 4)
            os.killpg(relay_process.pid, signal.SIGKILL)  # between sending and marking, likely
            relay_process.wait()
            kills += 1
        # What the killed relays left (their last leases ended), sent by one left to finish.
        time.sleep(1.1)
        subprocess.run(relay_once, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, check=True)
    finally:
        signals.inbox_event_duplicate.disconnect(on_duplicate)

    assert not OutboxMessage.objects.exclude(status="dispatched").exists()
    assert InboxEvent.objects.count() == messages
    assert Refund.objects.count() == messages  # each processed exactly once
    assert set(Counter(Refund.objects.values_list("event_id", flat=True)).values()) == {1}
    # Some batches were sent and not marked, because of a kill: their messages came twice.
    assert duplicates, "no relay was killed between sending and marking"


@pytest.mark.server_db
def test_a_relay_stopped_mid_batch_sends_the_message_in_hand_and_gives_back_the_rest(
    periodic_only,
):
    first = publish("tests.slow_refund", {"seconds": 2})
    rest = [publish("tests.slow_refund", {}) for _ in range(3)]
    relay_process = start_command("idempotency_outbox", "--forever", "--no-purge")
    try:
        deadline = time.monotonic() + 30
        while not OutboxMessage.objects.filter(pk=first.pk, attempts=1).exists():
            assert time.monotonic() < deadline, "the relay never claimed the batch"
            time.sleep(0.02)
        time.sleep(0.5)  # inside the dispatcher
    finally:
        ([code], [(out, err)]) = stop_commands([relay_process])

    assert code == 0, (out, err)
    assert out.splitlines()[-1] == "Stopped."
    first.refresh_from_db()
    assert (first.status, Refund.objects.filter(event_id=str(first.message_id)).count()) == (
        "dispatched",
        1,
    )
    # Not begun: due at once for the next relay, their attempt not counted.
    assert set(
        OutboxMessage.objects.filter(pk__in=[m.pk for m in rest]).values_list("status", "attempts")
    ) == {("pending", 0)}


@override_settings(IDEMPOTENCY={"OUTBOX_MAX_ATTEMPTS": 2})
def test_a_message_whose_relay_dies_every_time_ends_dead(periodic_only, recorded):
    # Two relays claimed it and died before recording anything.
    message = OutboxMessageFactory(payload={}, attempts=2)

    result = relay()

    message.refresh_from_db()
    assert (result.dead, message.status, message.attempts) == (1, "dead", 2)
    assert message.last_error == "The relay stopped during attempt 2."
    assert recorded == []


@pytest.fixture
def clock(monkeypatch):
    """The relay's clock, which only the test moves on."""

    class Clock:
        now = 0.0

        @classmethod
        def monotonic(cls):
            return cls.now

    monkeypatch.setattr(outbox_relay, "time", Clock)
    return Clock


def test_a_run_out_of_time_mid_batch_gives_back_what_it_did_not_send(periodic_only, clock):
    def slow(message):
        clock.now += 6  # each message takes six seconds to send

    register_dispatcher("tests.slow", slow)
    try:
        for n in range(3):
            publish("tests.slow", {"n": n})
        result = relay(max_seconds=10)
    finally:
        unregister("tests.slow")

    assert (result.dispatched, result.complete) == (2, False)
    left = OutboxMessage.objects.get(status="pending")
    assert left.attempts == 0
    assert left.next_attempt_at <= timezone.now()


def test_a_message_given_back_keeps_the_error_of_its_attempt_before(periodic_only, clock):
    def fails_slowly(message):
        if message.attempts == 2:
            clock.now += 6  # the relay's time runs out while the consumer does not answer
        msg = f"the consumer is down (attempt {message.attempts})"
        raise ConnectionError(msg)

    register_dispatcher("tests.slow", fails_slowly)
    try:
        message = publish("tests.slow", {})
        relay()
        result = relay(now=later(10**6), max_seconds=5)
    finally:
        unregister("tests.slow")

    message.refresh_from_db()
    assert (result.complete, message.status, message.attempts) == (False, "pending", 1)
    assert message.last_error == "ConnectionError: the consumer is down (attempt 1)"


def test_a_database_error_while_relaying_inline_does_not_reach_the_publisher(monkeypatch, caplog):
    def down(**kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(outbox_relay, "relay", down)
    with transaction.atomic():
        publish("tests.recorded", {})

    assert "could not relay the outbox after a commit" in caplog.text
    assert OutboxMessage.objects.get().status == "pending"


@pytest.mark.django_db(transaction=False)
def test_in_a_testcase_each_captured_commit_triggers_its_relay(
    django_capture_on_commit_callbacks, recorded
):
    for n in range(2):
        with django_capture_on_commit_callbacks(execute=True):
            publish("tests.recorded", {"n": n})
        assert len(recorded) == n + 1


def test_each_state_change_of_a_message_is_logged(periodic_only, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.outbox")
    with override_settings(IDEMPOTENCY={"OUTBOX_MAX_ATTEMPTS": 2}):
        message = publish(
            "tests.failing", {"fail_times": "always"}, headers={"X-Request-ID": "r-9"}
        )
        relay()
        relay(now=later(10**6))
    redeliver(OutboxMessage.objects.all())
    OutboxMessage.objects.update(payload={})
    relay()

    changes = [
        (
            r.idempotency_message_id,
            r.idempotency_outcome,
            r.from_state,
            r.to_state,
            r.correlation_id,
        )
        for r in caplog.records
        if hasattr(r, "from_state")
    ]
    one = str(message.message_id)
    assert changes == [
        (one, "failed", "pending", "pending", "r-9"),
        (one, "dead", "pending", "dead", "r-9"),
        (one, "redelivered", "dead", "pending", "r-9"),
        (one, "dispatched", "pending", "dispatched", "r-9"),
    ]


def _relay_a_message_dead_at_its_claim():
    return relay().dead


def _redeliver_every_message():
    return len(redeliver(OutboxMessage.objects.all()))


@pytest.mark.parametrize(
    ("make", "change"),
    [
        # Its relays died in both its attempts.
        (lambda: OutboxMessageFactory(payload={}, attempts=2), _relay_a_message_dead_at_its_claim),
        (lambda: OutboxMessageFactory(dead=True), _redeliver_every_message),
    ],
    ids=["dead at its claim", "redelivered"],
)
@override_settings(IDEMPOTENCY={"OUTBOX_MAX_ATTEMPTS": 2})
def test_a_change_of_a_message_is_logged_once_it_commits(periodic_only, caplog, make, change):
    caplog.set_level(logging.INFO, logger="django_idempotency.outbox")
    status = make().status

    # In a transaction of the caller's, which rolls back: under ATOMIC_REQUESTS the admin's
    # action runs in the request's.
    with transaction.atomic():
        assert change() == 1
        logged_before_the_commit = len(caplog.records)
        transaction.set_rollback(True)

    assert (logged_before_the_commit, len(caplog.records)) == (0, 0)
    assert OutboxMessage.objects.get().status == status
    assert change() == 1
    assert len([r for r in caplog.records if hasattr(r, "from_state")]) == 1
