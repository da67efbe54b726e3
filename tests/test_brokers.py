"""Broker consumers and the broker dispatcher (``django_idempotency.brokers``), on a real
RabbitMQ and a real Redis: each message recorded in the inbox by its producer's id, handled once,
acknowledged after the commit."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid

import amqp
import pytest
import redis
from amqp.exceptions import ChannelError
from django.core.management import CommandError, call_command
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.utils import timezone
from kombu import Connection, Exchange, Queue, binding

from django_idempotency.brokers import BrokerDispatcher, MessageConsumer, consume, handle
from django_idempotency.brokers import consumer as consumer_module
from django_idempotency.brokers.consumer import NO_MESSAGE_ID
from django_idempotency.core import correlation
from django_idempotency.inbox import receive
from django_idempotency.inbox import receiving as inbox_receiving
from django_idempotency.inbox.handlers import ANY_TYPE, register_handler, unregister
from django_idempotency.inbox.receiving import delivery_counts, payload_hash
from django_idempotency.models import InboxEvent, OutboxMessage
from django_idempotency.outbox import DispatchError, publish, register_dispatcher, relay
from django_idempotency.outbox.dispatchers import unregister as unregister_dispatcher
from tests.blackbox.brokers import answers
from tests.conftest import CI
from tests.testapp.models import LedgerEntry, Refund

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

    def send_raw(self, body: bytes, content_type="application/json", headers=None, **properties):
        """Publish ``body`` with these properties as a careless producer might: no serializer,
        and no check of what the properties hold (py-amqp writes a str with surrogatepass).
        With a ``routing_key`` of the queue's name, to the default exchange."""
        routing_key = properties.pop("routing_key", "payment.captured")
        exchange = "" if routing_key == self.queue.name else self.exchange.name
        with Connection(self.url) as connection:
            channel = connection.default_channel
            if self.url.startswith("amqp:"):
                message = amqp.Message(
                    body, content_type=content_type, application_headers=headers, **properties
                )
                channel.basic_publish(message, exchange=exchange, routing_key=routing_key)
                return
            item = {
                "body": base64.b64encode(body).decode(),
                "content-type": content_type,
                "content-encoding": "utf-8",
                "headers": headers or {},
                "properties": {
                    "delivery_tag": str(uuid.uuid4()),
                    "body_encoding": "base64",
                    "delivery_info": {"exchange": self.exchange.name, "routing_key": routing_key},
                    "priority": 0,
                    **properties,
                },
            }
            self.push(json.dumps(item).encode())

    def push(self, item: bytes) -> None:
        """Put ``item`` on the queue's Redis list as it is, as a producer without kombu might."""
        assert self.url.startswith("redis:")
        client = redis.Redis.from_url(self.url)
        client.lpush(self.queue.name, item)
        client.close()

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


def test_a_body_that_is_not_json_is_dead_at_once_under_its_own_id(broker, handled):
    broker.send(b"\x80\x04not json", message_id="m-1", serializer=None, content_type="x/pickle")
    broker.consume(1)
    event = refused(broker, handled)
    assert event.last_error == "the body is x/pickle, not JSON"
    assert event.event_id == "m-1"
    assert event.payload["body"] == "\ufffd\x04not json"


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


def test_a_message_whose_recording_fails_is_held_and_tried_again_not_requeued(
    broker, handled, monkeypatch
):
    failures = [OperationalError("the database went away")] * 3
    record = consumer_module.record

    def failing_three_times(*args):
        if failures:
            raise failures.pop()
        return record(*args)

    monkeypatch.setattr(consumer_module, "record", failing_three_times)
    monkeypatch.setattr(consumer_module, "HOLD_DELAY", 0.01)
    broker.send({"data": {}}, message_id="m-1")
    broker.consume(1)  # delivered once: held through the failures, not put back
    event = InboxEvent.objects.get()
    assert (event.status, event.deliveries) == (InboxEvent.Status.PROCESSED, 1)
    assert len(handled) == 1
    assert broker.ready() == 0


def consume_with_the_command(broker, *arguments, seconds=3):
    """Run ``idempotency_consume`` on the broker's queue until SIGTERM, ``seconds`` later."""
    stdout = io.StringIO()
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        call_command(
            "idempotency_consume",
            broker.queue.name,
            "--broker",
            broker.url,
            "--source",
            broker.source,
            *arguments,
            stdout=stdout,
        )
    finally:
        timer.cancel()
    return stdout.getvalue()


def test_the_command_consumes_until_sigterm(broker, handled):
    broker.send({"data": {}}, message_id="m-1")
    output = consume_with_the_command(
        broker, "--exchange", broker.exchange.name, "--routing-key", "#",
        "--transport-option", "visibility_timeout=60",
    )  # fmt: skip
    assert f"Consuming {broker.queue.name} as {broker.source}" in output
    assert output.endswith("Stopped.\n")
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
    event = refused(broker, handled)
    assert event.last_error == "the message's message_id is longer than 255 characters"
    assert event.event_id.startswith("sha256:")
    assert event.payload == {"data": {}}  # the body is JSON: kept as it is


def test_a_body_no_database_can_store_is_dead_at_once_not_redelivered_forever(broker, handled):
    # PostgreSQL's jsonb takes no NUL character: this body can never be recorded as it is.
    broker.send({"data": {"note": "a\u0000b"}}, message_id="m-1")
    broker.consume(1)
    event = refused(broker, handled)
    assert "NUL character or a lone surrogate" in event.last_error
    assert event.payload["body"].startswith('{"data": {"note": "a')
    assert event.event_id == "m-1"


# What a hostile or careless producer may send, and the reason the consumer keeps it dead with.
HOSTILE = [
    ({"type": "payment\x00captured"}, b'{"data": {}}', "the message's type holds a NUL character"),
    ({"type": "payment\ud800"}, b'{"data": {}}', "the message's type is not valid Unicode"),
    # Without an id to trust, these two are recorded by their body's hash.
    ({"message_id": "m\ud800"}, b'{"data": 2}', "the message's message_id is not valid Unicode"),
    ({"message_id": "m\x00"}, b'{"data": 3}', "the message's message_id holds a NUL character"),
    ({}, b"not json", "the body is not JSON"),
    ({}, b'{"data": "\\ud800"}', "NUL character or a lone surrogate"),
    ({}, b"[" * 40 + b"]" * 40, "the body is nested deeper than 31 levels"),
    ({}, b'{"a": NaN}', "the body holds NaN"),
    ({}, b"\xff\xfe binary", "the body is not UTF-8"),
]


def test_whatever_a_producer_sends_is_kept_dead_and_the_next_message_is_handled(broker, handled):
    for number, (properties, body, _reason) in enumerate(HOSTILE):
        broker.send_raw(body, **{"message_id": f"bad-{number}", "type": "t", **properties})
    broker.send({"data": {}}, message_id="good")
    broker.consume(len(HOSTILE) + 1)
    assert [call[0] for call in handled] == ["good"]
    dead = InboxEvent.objects.filter(status=InboxEvent.Status.DEAD).order_by("received_at", "pk")
    errors = [event.last_error for event in dead]
    assert len(errors) == len(HOSTILE), errors
    for error, (_properties, _body, reason) in zip(errors, HOSTILE, strict=True):
        assert reason in error
    assert broker.ready() == 0


def test_properties_that_are_not_utf8_are_kept_dead_and_the_next_message_is_handled(
    broker, handled
):
    if not broker.url.startswith("amqp:"):
        pytest.skip("AMQP's short strings")
    # py-amqp writes bytes as they are: what a producer in another language may send.
    broker.send_raw(b'{"data": 1}', message_id=b"\xff\xfe", type="t")
    broker.send_raw(b'{"data": 2}', message_id="m-2", type=b"\xc3(")
    broker.send({"data": {}}, message_id="good")
    broker.consume(3)
    assert [call[0] for call in handled] == ["good"]
    dead = InboxEvent.objects.filter(status=InboxEvent.Status.DEAD).order_by("pk")
    assert [event.payload for event in dead] == [{"data": 1}, {"data": 2}]
    for event in dead:
        assert event.last_error.startswith("the message's properties cannot be read (not UTF-8")
        assert event.event_id.startswith("sha256:")  # no id to trust
    assert broker.ready() == 0


def test_headers_no_database_can_store_are_left_out(broker, handled):
    headers = {"ok": "yes", "nul": "a\x00b", "surrogate": "\ud800", "number": 7}
    broker.send_raw(b'{"data": {}}', message_id="m-1", type="t", headers=headers)
    broker.consume(1)
    event = InboxEvent.objects.get()
    assert event.status == InboxEvent.Status.PROCESSED
    assert event.headers == {"ok": "yes", "number": "7"}


REDIS_ITEMS = [
    (b"not json", "the list item is not JSON"),
    (b"\xff\xfe", "the list item is not JSON"),
    (b"[1, 2]", "it is list, not an object"),
    (b'{"body": "e30="}', "it has no properties object"),
    (b'{"properties": {}}', "its properties have no delivery_tag"),
    (b'{"properties": {"delivery_tag": "t"}}', "no delivery_info"),
    (
        b'{"body": "!!!", "properties": {"delivery_tag": "t", "body_encoding": "base64", '
        b'"delivery_info": {"exchange": "", "routing_key": ""}}}',
        "its body is not base64",
    ),
]


def test_a_redis_list_item_that_is_no_message_is_kept_dead_and_the_next_is_handled(broker, handled):
    if not broker.url.startswith("redis:"):
        pytest.skip("Redis lists only")
    for item, _reason in REDIS_ITEMS:
        broker.push(item)
    broker.send({"data": {}}, message_id="good")
    for _ in broker.consumer().consume(timeout=10):  # kombu's own loop would raise and stop
        if handled:
            break
    assert [call[0] for call in handled] == ["good"]
    dead = InboxEvent.objects.filter(status=InboxEvent.Status.DEAD).order_by("pk")
    for event, (_item, reason) in zip(dead, REDIS_ITEMS, strict=True):
        assert reason in event.last_error
        assert event.payload["body_sha256"]


@pytest.mark.skipif(
    connection.vendor == "mysql", reason="InnoDB checks foreign keys at once, not at COMMIT"
)
def test_a_handler_whose_writes_fail_at_commit_keeps_the_messages_id_and_body(broker):
    # The payment is missing: the deferred foreign key fails the COMMIT, after the handler.
    register_handler(
        broker.source,
        ANY_TYPE,
        lambda event: LedgerEntry.objects.create(payment_id=event.payload["payment"], amount=1),
    )
    broker.send({"payment": 424242}, message_id="m-1")
    broker.consume(1)
    event = InboxEvent.objects.get()
    assert (event.event_id, event.payload) == ("m-1", {"payment": 424242})
    assert (event.status, event.attempts) == (InboxEvent.Status.FAILED, 1)
    assert event.last_error.startswith("IntegrityError")
    assert broker.ready() == 0
    # Delivered again, it is the same event: a duplicate, not a new one.
    broker.send({"payment": 424242}, message_id="m-1")
    broker.consume(1)
    delivery_counts.flush()
    event.refresh_from_db()
    assert (event.deliveries, InboxEvent.objects.count()) == (2, 1)


def test_a_handler_whose_on_commit_callback_raises_does_not_stop_the_consumer(broker):
    def handler(event):
        Refund.objects.create(event_id=event.event_id, amount=1)
        transaction.on_commit(lambda: 1 / 0)

    register_handler(broker.source, ANY_TYPE, handler)
    broker.send({"data": {}}, message_id="m-1")
    broker.send({"data": {}}, message_id="m-2")
    broker.consume(2)
    assert set(InboxEvent.objects.values_list("status", flat=True)) == {"processed"}
    assert Refund.objects.count() == 2
    assert broker.ready() == 0


def test_handle_refuses_to_run_inside_a_transaction_it_cannot_commit(broker, handled):
    broker.send({"data": {}}, message_id="m-1")
    connection_, message = broker.get()
    try:
        with transaction.atomic(), pytest.raises(RuntimeError, match="durable"):
            handle(broker.source, None, message)
    finally:
        message.requeue()
        connection_.close()
    assert InboxEvent.objects.count() == 0


def test_a_source_no_event_can_be_recorded_as_is_refused_at_once(broker):
    with pytest.raises(ValueError, match="1 to 100 characters"):
        MessageConsumer(Connection(broker.url), [broker.queue], source="s" * 101)
    with pytest.raises(CommandError, match="1 to 100 characters"):
        call_command("idempotency_consume", "q", "--broker", broker.url, "--source", "s" * 101)


def test_a_queue_the_operator_declared_otherwise_fails_the_command_at_start(broker, handled):
    if not broker.url.startswith("amqp:"):
        pytest.skip("RabbitMQ's queue arguments")
    # Declared again as the operator would: a quorum queue, bound to nothing.
    broker.queue = Queue(
        broker.queue.name, durable=True, queue_arguments={"x-queue-type": "quorum"}
    )
    with Connection(broker.url) as connection:
        broker.queue(connection.default_channel).delete()
        broker.queue(connection.default_channel).declare()
    broker.send_raw(b'{"data": {}}', message_id="m-1", routing_key=broker.queue.name)
    started = time.monotonic()
    with pytest.raises(CommandError, match=r"PRECONDITION_FAILED.*x-queue-type.*--queue-argument"):
        call_command(
            "idempotency_consume", broker.queue.name, "--broker", broker.url,
            "--source", broker.source,
        )  # fmt: skip
    assert time.monotonic() - started < 10
    output = consume_with_the_command(broker, "--queue-argument", "x-queue-type=quorum")
    assert output.endswith("Stopped.\n")
    assert [call[0] for call in handled] == ["m-1"]
    assert broker.ready() == 0


def test_the_same_message_id_with_another_body_is_kept_as_a_conflict(broker, handled):
    broker.send({"data": {"amount": 1}}, message_id="m-1")
    broker.send({"data": {"amount": 2}}, message_id="m-1")
    broker.consume(2)
    event = InboxEvent.objects.get()
    assert event.payload == {"data": {"amount": 1}}
    assert (event.conflicts, event.conflicting_payload) == (1, {"data": {"amount": 2}})
    assert event.conflicting_payload_hash == payload_hash({"data": {"amount": 2}})
    assert event.last_conflict_at > event.received_at
    assert [call[0] for call in handled] == ["m-1"]
    assert broker.ready() == 0


def test_a_message_recorded_but_never_dispatched_is_processed_when_delivered_again(
    broker, handled, monkeypatch
):
    # An earlier delivery recorded it, then its consumer died before dispatching it.
    monkeypatch.setattr(inbox_receiving, "dispatch", lambda pk: None)
    with transaction.atomic():
        receive(broker.source, "m-1", "payment.captured", {"data": {}})
    monkeypatch.undo()
    assert InboxEvent.objects.get().status == InboxEvent.Status.RECEIVED
    broker.send({"data": {}}, message_id="m-1")
    broker.consume(1)
    # Now, not a minute later by the periodic run.
    assert InboxEvent.objects.get().status == InboxEvent.Status.PROCESSED
    assert [call[0] for call in handled] == ["m-1"]


def test_the_consumer_logs_each_messages_outcome_as_the_webhook_receiver_does(
    broker, handled, caplog
):
    # One record per message with its outcome in the inbox's structured fields, as a webhook
    # delivery gets: an operator follows a queue in the logs without reading the table.
    broker.send({"data": {}}, message_id="m-1")
    broker.send({"data": {}}, message_id="m-1")
    broker.send({"data": {"other": 1}}, message_id="m-1")
    broker.send({"data": {"fail": True}}, message_id="m-2")
    broker.send(b"\x80\x04not json", message_id="m-3", serializer=None, content_type="x/pickle")
    with caplog.at_level(logging.INFO, logger="django_idempotency"):
        broker.consume(5)
    logged = [
        (record.idempotency_event_id, record.idempotency_outcome, record.levelname)
        for record in caplog.records
        if getattr(record, "idempotency_outcome", "received") != "received"
    ]
    assert logged == [
        ("m-1", "processed", "INFO"),
        ("m-1", "duplicate", "INFO"),
        ("m-1", "conflict", "WARNING"),
        ("m-2", "failed", "WARNING"),
        ("m-3", "dead", "ERROR"),
    ]
    assert all(
        record.idempotency_source == broker.source
        for record in caplog.records
        if hasattr(record, "idempotency_outcome")
    )
