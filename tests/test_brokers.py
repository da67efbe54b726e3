"""Broker consumers and the broker dispatcher (``django_idempotency.brokers``), on a real
RabbitMQ and a real Redis: each message recorded in the inbox by its producer's id, handled once,
acknowledged after the commit."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import socket
import threading
import time
import uuid

import pytest
from amqp.exceptions import ChannelError
from django.core.management import CommandError, call_command
from django.db import OperationalError
from django.test import override_settings
from django.utils import timezone
from kombu import Connection, Exchange, Queue, binding

from django_idempotency.brokers import BrokerDispatcher, MessageConsumer, consume
from django_idempotency.brokers import consumer as consumer_module
from django_idempotency.brokers.consumer import NO_MESSAGE_ID
from django_idempotency.inbox.handlers import ANY_TYPE, register_handler, unregister
from django_idempotency.inbox.receiving import delivery_counts
from django_idempotency.models import InboxEvent, OutboxMessage
from django_idempotency.operations import correlation
from django_idempotency.outbox import DispatchError, publish, register_dispatcher, relay
from django_idempotency.outbox.dispatchers import unregister as unregister_dispatcher
from tests.blackbox.brokers import answers
from tests.conftest import CI
from tests.testapp.models import Refund

pytestmark = pytest.mark.django_db(transaction=True)

BROKERS = {
    "rabbitmq": ("amqp://guest:guest@127.0.0.1:5672//", 5672),
    "redis": (f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_CELERY_DB', '14')}", 6379),
}


class Broker:
    """An exchange and a queue of the test's own on a real broker, and what the test does there."""

    def __init__(self, url: str) -> None:
        self.url = url
        name = f"test-brokers-{uuid.uuid4().hex[:12]}"
        self.exchange = Exchange(name, type="topic", durable=True)
        self.queue = Queue(name, bindings=[binding(self.exchange, routing_key="#")], durable=True)
        self.source = name
        self.dispatchers: list[BrokerDispatcher] = []
        with Connection(url) as connection:
            self.queue(connection.default_channel).declare()

    def dispatcher(self, **options) -> BrokerDispatcher:
        dispatcher = BrokerDispatcher(self.url, self.exchange.name, **options)
        self.dispatchers.append(dispatcher)
        return dispatcher

    def consumer(self, **options) -> MessageConsumer:
        return MessageConsumer(Connection(self.url), [self.queue], source=self.source, **options)

    def consume(self, messages: int, **options) -> None:
        """Consume until ``messages`` were delivered and done with, in this thread; disconnect."""
        consumer = self.consumer(**options)
        done = 0

        def counted(method):
            def call(*args):
                nonlocal done
                method(*args)
                done += 1

            return call

        consumer.on_message = counted(consumer.on_message)
        consumer.on_decode_error = counted(consumer.on_decode_error)
        deadline = time.monotonic() + 10
        with consumer.consumer_context() as (connection, _channel, _consumers):
            while done < messages:
                assert time.monotonic() < deadline, f"{done} of {messages} messages delivered"
                with contextlib.suppress(socket.timeout):
                    connection.drain_events(timeout=0.2)

    def send(self, body, **properties) -> None:
        """Publish as any producer would, not through the outbox."""
        with Connection(self.url) as connection:
            connection.Producer().publish(
                body,
                exchange=self.exchange,
                routing_key=properties.pop("routing_key", "payment.captured"),
                declare=[self.exchange],
                **{"serializer": "json", **properties},
            )

    def get(self):
        """Take one message without acknowledging it: a consumer that dies with it."""
        connection = Connection(self.url)
        queue = self.queue(connection.default_channel)
        # Declared here too: kombu's Redis transport puts a message back by its exchange's
        # type, which it knows only of exchanges this connection declared.
        queue.declare()
        return connection, queue.get(no_ack=False)

    def ready(self) -> int:
        """Messages in the queue that no consumer holds."""
        with Connection(self.url) as connection:
            try:
                declared = self.queue(connection.default_channel).queue_declare(passive=True)
            except ChannelError:
                # Redis keeps no list for an empty queue, and calls it missing.
                assert self.url.startswith("redis:")
                return 0
            return int(declared.message_count)

    def delete(self) -> None:
        for dispatcher in self.dispatchers:
            dispatcher.close()
        with Connection(self.url) as connection:
            channel = connection.default_channel
            self.queue(channel).delete()
            self.exchange(channel).delete()


@pytest.fixture(params=list(BROKERS))
def broker(request):
    url, port = BROKERS[request.param]
    if not answers(port):
        if CI:
            pytest.fail(f"CI=true needs {request.param} on 127.0.0.1:{port}")
        pytest.skip(f"needs {request.param} on 127.0.0.1:{port}")
    broker = Broker(url)
    yield broker
    broker.delete()
    unregister(broker.source, ANY_TYPE)


@pytest.fixture
def handled(broker):
    """Every event the broker's source's handler ran for; it writes a refund for each."""
    calls = []

    def handler(event):
        calls.append((event.event_id, correlation.get_correlation_id()))
        Refund.objects.create(event_id=event.event_id, amount=1)
        if event.payload.get("data", {}).get("fail"):
            raise ValueError("the handler refuses this one")

    register_handler(broker.source, ANY_TYPE, handler)
    return calls


def refused(broker, handled) -> InboxEvent:
    """The one event, once its message is consumed: dead, never handled, acknowledged."""
    event = InboxEvent.objects.get()
    assert event.status == InboxEvent.Status.DEAD
    assert handled == []
    assert broker.ready() == 0
    return event


def outbox_message(**fields) -> OutboxMessage:
    fields = {
        "message_id": uuid.uuid4(),
        "topic": "payment.captured",
        "payload": {"payment": 7},
        "created_at": timezone.now(),
        **fields,
    }
    return OutboxMessage(**fields)


def test_a_published_message_is_handled_once_and_acknowledged(broker, handled):
    message = outbox_message()
    broker.dispatcher()(message)
    broker.consume(1)
    event = InboxEvent.objects.get()
    assert (event.source, event.event_id) == (broker.source, str(message.message_id))
    assert event.event_type == "payment.captured"
    assert event.status == InboxEvent.Status.PROCESSED
    assert event.attempts == 1
    assert event.payload["data"] == {"payment": 7}
    assert [call[0] for call in handled] == [str(message.message_id)]
    assert Refund.objects.count() == 1
    assert broker.ready() == 0


def test_the_same_message_published_three_times_is_handled_once(broker, handled):
    message = outbox_message()
    dispatcher = broker.dispatcher()
    for _ in range(3):
        dispatcher(message)  # a relay that died before marking it sent, twice
    broker.consume(3)
    delivery_counts.flush()
    event = InboxEvent.objects.get()
    assert event.deliveries == 3
    assert len(handled) == 1
    assert Refund.objects.count() == 1
    assert broker.ready() == 0


def test_a_message_redelivered_after_its_consumer_died_is_handled_once(broker, handled):
    broker.send({"data": {}}, message_id="m-1")
    connection, _message = broker.get()
    connection.close()  # died holding it: the broker delivers it again
    broker.consume(1)
    event = InboxEvent.objects.get()
    assert event.status == InboxEvent.Status.PROCESSED
    assert handled == [("m-1", None)]
    assert broker.ready() == 0


def test_a_message_requeued_after_it_was_recorded_is_not_handled_again(broker, handled):
    broker.send({"data": {}}, message_id="m-1")
    broker.consume(1)
    broker.send({"data": {}}, message_id="m-1")
    connection, message = broker.get()
    message.requeue()  # redelivered, marked so
    connection.close()
    broker.consume(1)
    assert len(handled) == 1
    assert broker.ready() == 0


def test_a_failing_handler_rolls_its_writes_back_and_the_event_is_retried_later(broker, handled):
    broker.send({"data": {"fail": True}}, message_id="m-1")
    broker.consume(1)
    event = InboxEvent.objects.get()
    assert event.status == InboxEvent.Status.FAILED
    assert "the handler refuses this one" in event.last_error
    assert event.next_attempt_at > timezone.now()
    assert Refund.objects.count() == 0  # rolled back with the attempt
    assert broker.ready() == 0  # acknowledged: a failing message does not block the queue


@override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 1})
def test_a_poison_message_goes_dead_after_the_attempt_limit_and_is_acknowledged(broker, handled):
    broker.send({"data": {"fail": True}}, message_id="m-1")
    broker.consume(1)
    assert InboxEvent.objects.get().status == InboxEvent.Status.DEAD
    assert broker.ready() == 0


def test_a_message_without_an_id_is_dead_at_once_and_never_handled(broker, handled):
    for _ in range(2):
        broker.send({"data": {"payment": 1}})
    broker.consume(2)
    event = refused(broker, handled)
    assert event.last_error == NO_MESSAGE_ID
    assert event.event_id.startswith("sha256:")


def test_a_body_that_cannot_be_read_is_dead_at_once(broker, handled):
    broker.send(b"\x80\x04not json", message_id="m-1", serializer=None, content_type="x/pickle")
    broker.consume(1)
    assert "cannot be read (x/pickle)" in refused(broker, handled).last_error


def test_the_correlation_id_travels_from_the_headers_into_the_handlers_logs(
    broker, handled, caplog
):
    message = outbox_message(headers={correlation.HEADER: "trace-42"})
    broker.dispatcher()(message)
    with caplog.at_level(logging.INFO, logger="django_idempotency.inbox"):
        broker.consume(1)
    assert handled == [(str(message.message_id), "trace-42")]
    processed = [r for r in caplog.records if r.getMessage().startswith("processed inbox event")]
    assert [r.correlation_id for r in processed] == ["trace-42"]


def test_the_outbox_publishes_with_its_message_id_topic_and_headers(broker, handled):
    register_dispatcher("payment.captured", broker.dispatcher(source="payments"))
    try:
        with correlation.bind("trace-7"):
            message = publish("payment.captured", {"payment": 1}, ordering_key="payment-1")
        relay()
    finally:
        unregister_dispatcher("payment.captured")
    message.refresh_from_db()
    assert message.status == OutboxMessage.Status.DISPATCHED
    connection, delivered = broker.get()
    try:
        assert delivered.properties["message_id"] == str(message.message_id)
        assert delivered.properties["type"] == "payment.captured"
        assert delivered.delivery_info["routing_key"] == "payment.captured"
        assert delivered.headers["source"] == "payments"
        assert delivered.headers["ordering-key"] == "payment-1"
        assert delivered.headers[correlation.HEADER] == "trace-7"
        assert delivered.decode()["id"] == str(message.message_id)
    finally:
        delivered.requeue()
        connection.close()


def test_a_broker_that_does_not_answer_fails_the_attempt():
    dispatcher = BrokerDispatcher("amqp://guest:guest@127.0.0.1:1//", "nowhere", timeout=1)
    with pytest.raises(DispatchError, match="could not publish to 'nowhere'"):
        dispatcher(outbox_message())


def test_consumers_asked_to_stop_finish_the_message_in_hand(broker):
    started, release = threading.Event(), threading.Event()

    def slow(event):
        started.set()
        release.wait(10)
        Refund.objects.create(event_id=event.event_id, amount=1)

    register_handler(broker.source, ANY_TYPE, slow)
    stop = threading.Event()
    consumers = threading.Thread(
        target=consume,
        args=(broker.url, [broker.queue]),
        kwargs={"source": broker.source, "concurrency": 2, "stop": stop},
    )
    consumers.start()
    broker.send({"data": {}}, message_id="m-1")
    assert started.wait(10)
    stop.set()  # what SIGTERM does
    release.set()
    consumers.join(15)
    assert not consumers.is_alive()
    assert InboxEvent.objects.get().status == InboxEvent.Status.PROCESSED
    assert Refund.objects.count() == 1
    assert broker.ready() == 0


def test_a_consumer_that_fails_stops_them_all_with_its_error(broker, monkeypatch):
    def broken(self, consumer, channel):
        raise RuntimeError("a bug in the consumer")

    monkeypatch.setattr(MessageConsumer, "get_consumers", broken)
    with pytest.raises(RuntimeError, match="a bug in the consumer"):
        # Without the failure, it would consume until stop is set: never, here.
        consume(broker.url, [broker.queue], source=broker.source, stop=threading.Event())


def test_a_message_whose_recording_fails_goes_back_to_the_queue(broker, handled, monkeypatch):
    failures = [OperationalError("the database went away")]
    record = consumer_module.handle

    def failing_once(*args):
        if failures:
            raise failures.pop()
        return record(*args)

    monkeypatch.setattr(consumer_module, "handle", failing_once)
    monkeypatch.setattr(consumer_module, "REQUEUE_DELAY", 0)
    broker.send({"data": {}}, message_id="m-1")
    broker.consume(2)  # refused once, then delivered again
    assert InboxEvent.objects.get().status == InboxEvent.Status.PROCESSED
    assert len(handled) == 1
    assert broker.ready() == 0


def test_the_command_consumes_until_sigterm(broker, handled):
    broker.send({"data": {}}, message_id="m-1")
    stdout = io.StringIO()
    # SIGTERM, as a supervisor sends it, once the message had time to be handled.
    timer = threading.Timer(3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        call_command(
            "idempotency_consume",
            broker.queue.name,
            "--broker",
            broker.url,
            "--exchange",
            broker.exchange.name,
            "--routing-key",
            "#",
            "--source",
            broker.source,
            "--transport-option",
            "visibility_timeout=60",
            stdout=stdout,
        )
    finally:
        timer.cancel()
    assert f"Consuming {broker.queue.name} as {broker.source}" in stdout.getvalue()
    assert stdout.getvalue().endswith("Stopped.\n")
    assert [call[0] for call in handled] == ["m-1"]
    assert broker.ready() == 0


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        (["--routing-key", "#"], "--routing-key needs --exchange"),
        (["--prefetch", "0"], "at least 1"),
        (["--transport-option", "visibility_timeout"], "NAME=VALUE"),
    ],
)
def test_the_command_refuses_options_that_cannot_work(arguments, error):
    with pytest.raises(CommandError, match=error):
        call_command("idempotency_consume", "q", "--broker", "memory://", *arguments)


def test_a_message_id_longer_than_an_event_holds_is_dead_at_once(broker, handled):
    if broker.url.startswith("amqp:"):
        pytest.skip("AMQP itself refuses a message_id longer than 255 bytes")
    broker.send({"data": {}}, message_id="m" * 300)
    broker.consume(1)
    assert "longer than 255 characters" in refused(broker, handled).last_error


@pytest.mark.postgresql
def test_a_message_the_database_refuses_is_dead_at_once_not_redelivered_forever(broker, handled):
    # PostgreSQL's jsonb takes no NUL character: this body can never be recorded as it is.
    broker.send({"data": {"note": "a\u0000b"}}, message_id="m-1")
    broker.consume(1)
    event = refused(broker, handled)
    assert event.last_error.startswith("the database refused the message")
    assert event.payload["body"].startswith('{"data": {"note": "a')
