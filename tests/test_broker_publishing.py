"""Publishing outbox messages to a broker (``BrokerDispatcher``), on a real RabbitMQ and a real
Redis: a message that no queue takes is not counted sent, a refusal says why, and no wait on the
broker outlasts the dispatcher's timeout or the time its relay has left. A relay's batch is
published whole, then its confirms are awaited together, each ack, nack or return matched to its
message: a message is marked sent only once its ack came, and one not confirmed when the wait
ends is retried, never lost."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta

import amqp
import pytest
from django.db import connections
from django.test import override_settings
from django.utils import timezone
from kombu import Connection, Exchange, Queue, binding
from prometheus_client import REGISTRY

from django_idempotency.brokers import BrokerDispatcher
from django_idempotency.brokers.publisher import NACKED
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox import DispatchError, publish, register_dispatcher, relay
from django_idempotency.outbox import relaying as outbox_relay
from django_idempotency.outbox.dispatchers import unregister
from tests.blackbox.brokers import Proxy, answers
from tests.blackbox.harness import Redis, wait_for
from tests.conftest import CI

pytestmark = pytest.mark.django_db(transaction=True)

BROKERS = {
    "rabbitmq": ("amqp://guest:guest@127.0.0.1:5672//", 5672),
    "redis": (f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_CELERY_DB', '14')}", 6379),
}
TOPIC = "payment.captured"
OTHER_TOPIC = "refund.issued"
UNROUTABLE = "django_idempotency_broker_unroutable_total"
# What a test allows a call bounded by a timeout of one second: the bound, and time to spare on
# a loaded machine. A call that is not bounded at all is given up on past WAIT_AT_MOST.
ONE_SECOND_AND_SOME = 3.0
WAIT_AT_MOST = 20.0


def needs(name: str) -> str:
    url, port = BROKERS[name]
    if not answers(port):
        if CI:
            pytest.fail(f"CI=true needs {name} on 127.0.0.1:{port}")
        pytest.skip(f"needs {name} on 127.0.0.1:{port}")
    return url


class Route:
    """An exchange of the test's own, with a queue bound to it for ``bound_key`` or none."""

    def __init__(self, url: str, bound_key: str | None) -> None:
        self.url = url
        name = f"test-publishing-{uuid.uuid4().hex[:12]}"
        self.exchange = Exchange(name, type="topic", durable=True)
        self.queues: list[Queue] = []
        self.dispatchers: list[BrokerDispatcher] = []
        if bound_key is not None:
            self.bind(bound_key)

    def bind(self, key: str, **arguments) -> Queue:
        queue = Queue(
            f"{self.exchange.name}-{len(self.queues)}",
            bindings=[binding(self.exchange, routing_key=key)],
            durable=True,
            queue_arguments=arguments or None,
        )
        with Connection(self.url) as connection:
            queue(connection.default_channel).declare()
        self.queues.append(queue)
        return queue

    def dispatcher(self, url: str | None = None, **options) -> BrokerDispatcher:
        dispatcher = BrokerDispatcher(url or self.url, self.exchange.name, **options)
        self.dispatchers.append(dispatcher)
        return dispatcher

    def delete(self) -> None:
        for dispatcher in self.dispatchers:
            dispatcher.close()
        with Connection(self.url) as connection:
            channel = connection.default_channel
            for queue in self.queues:
                queue(channel).delete()
            self.exchange(channel).delete()


@pytest.fixture
def routes():
    made: list[Route] = []

    def make(url: str, bound_key: str | None = None) -> Route:
        made.append(Route(url, bound_key))
        return made[-1]

    make.made = made
    yield make
    for route in made:
        route.delete()


@pytest.fixture(autouse=True)
def periodic_only(monkeypatch):
    """No relay after commit: only the test's own calls relay."""
    monkeypatch.setattr(outbox_relay, "trigger", lambda: None)
    yield
    unregister(TOPIC, OTHER_TOPIC)


def later(seconds):
    return lambda: timezone.now() + timedelta(seconds=seconds)


def unroutable(route: Route) -> float:
    labels = {"exchange": route.exchange.name, "topic": TOPIC}
    return REGISTRY.get_sample_value(UNROUTABLE, labels) or 0.0


@pytest.fixture
def worker(routes):
    """Run calls in a thread of their own, always the same (a dispatcher keeps a connection per
    thread), and give up on one that outlasts its bound: ``worker(call, *args, within=s)``
    returns what the call returned and the seconds it took, or raises what it raised."""
    pool = ThreadPoolExecutor(max_workers=1)

    def timed(call, *args, **kwargs):
        started = time.monotonic()
        try:
            return call(*args, **kwargs), time.monotonic() - started
        finally:
            connections.close_all()

    def run(call, *args, within: float = WAIT_AT_MOST, **kwargs):
        future = pool.submit(timed, call, *args, **kwargs)
        try:
            return future.result(timeout=within)
        except FuturesTimeout:
            pytest.fail(f"still waiting on the broker after {within} s")

    yield run
    # The thread's own connections are closed in it.
    dispatchers = [dispatcher for route in routes.made for dispatcher in route.dispatchers]
    closing = pool.submit(lambda: [dispatcher.close() for dispatcher in dispatchers])
    with contextlib.suppress(FuturesTimeout):
        closing.result(timeout=ONE_SECOND_AND_SOME)
    pool.shutdown(wait=False, cancel_futures=True)


def a_message() -> OutboxMessage:
    return OutboxMessage(
        message_id=uuid.uuid4(), topic=TOPIC, payload={}, created_at=timezone.now()
    )


@pytest.mark.parametrize(
    ("broker", "bound_key"),
    [
        ("rabbitmq", None),
        ("rabbitmq", "refund.*"),
        ("redis", None),
        ("redis", "refund.*"),
    ],
    ids=["rabbitmq-no-queue", "rabbitmq-other-key", "redis-no-queue", "redis-other-key"],
)
def test_a_message_no_queue_is_bound_for_is_retried_then_dead_with_the_reason(
    routes, broker, bound_key
):
    route = routes(needs(broker), bound_key)
    register_dispatcher(TOPIC, route.dispatcher())
    counted = unroutable(route)
    message = publish(TOPIC, {"payment": 1})
    reason = (
        f"DispatchError: could not publish to {route.exchange.name!r}: "
        f"no queue is bound for routing key {TOPIC!r}"
    )

    with override_settings(IDEMPOTENCY={"OUTBOX_MAX_ATTEMPTS": 2}):
        first = relay(random=lambda: 0.5)  # the retry 15 s away, not drawn
        message.refresh_from_db()
        assert (first.dispatched, first.failed) == (0, 1)
        assert (message.status, message.attempts) == ("pending", 1)
        assert message.last_error.startswith(reason), message.last_error
        assert message.next_attempt_at > timezone.now()

        second = relay(now=later(3600))
        message.refresh_from_db()
        assert (second.dispatched, second.dead) == (0, 1)
        assert (message.status, message.attempts) == ("dead", 2)
        assert message.last_error.startswith(reason), message.last_error

    assert unroutable(route) == counted + 2


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_a_message_a_queue_is_bound_for_is_sent_and_not_counted_unroutable(routes, broker):
    route = routes(needs(broker), "payment.*")
    register_dispatcher(TOPIC, route.dispatcher())
    counted = unroutable(route)
    message = publish(TOPIC, {"payment": 1})

    relay()

    message.refresh_from_db()
    assert (message.status, message.last_error) == ("dispatched", "")
    assert unroutable(route) == counted


def test_a_message_the_broker_refuses_fails_with_what_the_broker_said(routes):
    route = routes(needs("rabbitmq"))
    # A queue that takes nothing, and refuses rather than drops: RabbitMQ answers basic.nack.
    route.bind("#", **{"x-max-length": 0, "x-overflow": "reject-publish"})
    register_dispatcher(TOPIC, route.dispatcher())
    message = publish(TOPIC, {"payment": 1})

    relay()

    message.refresh_from_db()
    assert (message.status, message.attempts) == ("pending", 1)
    assert message.last_error == (
        f"DispatchError: could not publish to {route.exchange.name!r}: the broker refused the "
        "message (basic.nack): a queue it was routed to rejects publishes (full, with "
        "x-overflow reject-publish) or could not store it"
    )


@pytest.fixture
def frozen_rabbitmq(routes):
    """A route on RabbitMQ, reached through a proxy that a test can freeze."""
    url = needs("rabbitmq")
    proxy = Proxy(BROKERS["rabbitmq"][1])
    route = routes(url, "#")
    route.proxied = url.replace(":5672", f":{proxy.port}")
    yield route, proxy
    proxy.close()


def test_a_broker_that_stops_answering_fails_the_publish_within_its_timeout(
    frozen_rabbitmq, worker
):
    route, proxy = frozen_rabbitmq
    dispatcher = route.dispatcher(route.proxied, timeout=1)
    worker(dispatcher, a_message())  # connected, and confirmed
    proxy.freeze()

    started = time.monotonic()
    with pytest.raises(DispatchError, match="no answer from the broker within 1 s"):
        worker(dispatcher, a_message())
    assert time.monotonic() - started < ONE_SECOND_AND_SOME
    # The failed connection was dropped without waiting; nothing is left to close.
    worker(dispatcher.close, within=ONE_SECOND_AND_SOME)


def test_the_next_publish_after_a_stalled_one_connects_anew(frozen_rabbitmq, worker):
    route, proxy = frozen_rabbitmq
    dispatcher = route.dispatcher(route.proxied, timeout=1)
    worker(dispatcher, a_message())
    proxy.freeze()
    with pytest.raises(DispatchError):
        worker(dispatcher, a_message())
    proxy.cut()
    proxy.thaw()

    worker(dispatcher, a_message(), within=ONE_SECOND_AND_SOME)


def test_closing_a_connection_to_a_broker_that_stopped_answering_is_bounded(
    frozen_rabbitmq, worker
):
    route, proxy = frozen_rabbitmq
    dispatcher = route.dispatcher(route.proxied, timeout=1)
    worker(dispatcher, a_message())
    proxy.freeze()

    worker(dispatcher.close, within=ONE_SECOND_AND_SOME)


def test_a_relay_out_of_time_stops_waiting_and_gives_the_message_back(frozen_rabbitmq, worker):
    route, proxy = frozen_rabbitmq
    # The dispatcher would wait ten seconds; the relay has one.
    register_dispatcher(TOPIC, route.dispatcher(route.proxied, timeout=10))
    publish(TOPIC, {"payment": 0})
    worker(relay)  # connected
    proxy.freeze()
    message = publish(TOPIC, {"payment": 1})

    result, seconds = worker(relay, max_seconds=1)

    assert seconds < ONE_SECOND_AND_SOME
    assert (result.dispatched, result.failed, result.complete) == (0, 0, False)
    message.refresh_from_db()
    # Not sent, and not an attempt: the periodic relay sends it, with all its attempts left.
    assert (message.status, message.attempts) == ("pending", 0)
    assert message.next_attempt_at <= timezone.now()


def test_a_connection_the_broker_closed_since_the_last_publish_is_replaced(frozen_rabbitmq):
    route, proxy = frozen_rabbitmq
    register_dispatcher(TOPIC, route.dispatcher(route.proxied))
    publish(TOPIC, {"payment": 0})
    relay()
    proxy.cut()  # as a broker restarted between two relays does
    message = publish(TOPIC, {"payment": 1})

    relay()

    message.refresh_from_db()
    assert (message.status, message.attempts) == ("dispatched", 1)


@pytest.fixture
def own_redis(tmp_path):
    redis = Redis(tmp_path / "redis.log")
    try:
        redis.wait_until_up()
        yield redis
    finally:
        redis.stop()


def test_a_redis_that_stops_answering_fails_the_publish_within_its_timeout(
    own_redis, routes, worker
):
    route = routes(own_redis.url, "#")
    dispatcher = route.dispatcher(timeout=1)
    worker(dispatcher, a_message())
    own_redis.freeze()
    try:
        started = time.monotonic()
        with pytest.raises(DispatchError):
            worker(dispatcher, a_message())
        assert time.monotonic() - started < ONE_SECOND_AND_SOME
        worker(dispatcher.close, within=ONE_SECOND_AND_SOME)
    finally:
        own_redis.thaw()


# A relay's batch: published whole, then its confirms awaited together.


class RoundTrips:
    """How often the client stopped publishing to wait for what RabbitMQ answers."""

    def __init__(self) -> None:
        self.count = 0
        self.published = False


@pytest.fixture
def round_trips(monkeypatch):
    """Count the client's waits on RabbitMQ that follow a publish: one per message when each
    confirm is awaited alone, one per batch when they are awaited together. (A publish also
    reads, without waiting, what the broker sent: that is no round trip.)"""
    trips = RoundTrips()
    publish_frame, drain = amqp.Channel._basic_publish, amqp.Connection.drain_events

    def publishing(channel, *args, **kwargs):
        trips.published = True
        return publish_frame(channel, *args, **kwargs)

    def draining(connection, timeout=None, **kwargs):
        if timeout != 0 and trips.published:
            trips.count += 1
            trips.published = False
        return drain(connection, timeout=timeout, **kwargs)

    # py-amqp's channel publishes through either name, as confirms are on or off.
    monkeypatch.setattr(amqp.Channel, "_basic_publish", publishing)
    monkeypatch.setattr(amqp.Channel, "basic_publish", publishing)
    monkeypatch.setattr(amqp.Connection, "drain_events", draining)
    return trips


def queued(url: str, queue: str) -> list[str]:
    """The ids of the messages ``queue`` holds, taken off it."""
    ids = []
    with Connection(url) as connection:
        channel = connection.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            ids.append(message.properties["message_id"])
    return ids


def outbox(messages: list[OutboxMessage]) -> list[tuple[str, int, str]]:
    for message in messages:
        message.refresh_from_db()
    return [(message.status, message.attempts, message.last_error) for message in messages]


def test_a_batch_waits_once_for_all_its_confirms(routes, round_trips):
    route = routes(needs("rabbitmq"), "#")
    register_dispatcher(TOPIC, route.dispatcher())
    messages = [publish(TOPIC, {"payment": n}) for n in range(30)]

    result = relay(batch_size=10)

    assert (result.batches, result.dispatched) == (3, 30)
    assert round_trips.count == 3  # one per batch, not one per message
    assert {status for status, _, _ in outbox(messages)} == {"dispatched"}
    assert sorted(queued(route.url, route.queues[0].name)) == sorted(
        str(message.message_id) for message in messages
    )


@pytest.mark.parametrize("broker", ["rabbitmq", "redis"])
def test_the_one_message_of_a_batch_no_queue_takes_fails_alone_with_the_reason(routes, broker):
    route = routes(needs(broker), "payment.*")
    dispatcher = route.dispatcher()
    register_dispatcher(TOPIC, dispatcher)
    register_dispatcher(OTHER_TOPIC, dispatcher)
    labels = {"exchange": route.exchange.name, "topic": OTHER_TOPIC}
    counted = REGISTRY.get_sample_value(UNROUTABLE, labels) or 0.0
    topics = [TOPIC, TOPIC, OTHER_TOPIC, TOPIC, TOPIC]
    messages = [publish(topic, {"payment": n}) for n, topic in enumerate(topics)]

    result = relay()

    assert (result.batches, result.dispatched, result.failed) == (1, 4, 1)
    reason = (
        f"DispatchError: could not publish to {route.exchange.name!r}: no queue is bound for "
        f"routing key {OTHER_TOPIC!r} ("
    )
    states = outbox(messages)
    assert states[:2] + states[3:] == [("dispatched", 1, "")] * 4
    status, attempts, error = states[2]
    assert (status, attempts) == ("pending", 1)
    assert error.startswith(reason), error
    if broker == "rabbitmq":
        assert error.endswith("(the broker returned the message: 312 NO_ROUTE)"), error
    assert REGISTRY.get_sample_value(UNROUTABLE, labels) == counted + 1


def test_the_messages_of_a_batch_a_full_queue_refuses_fail_and_the_others_are_sent(routes):
    route = routes(needs("rabbitmq"))
    # Two messages fill it; RabbitMQ nacks each one after that.
    route.bind("#", **{"x-max-length": 2, "x-overflow": "reject-publish"})
    register_dispatcher(TOPIC, route.dispatcher())
    messages = [publish(TOPIC, {"payment": n}) for n in range(5)]

    result = relay()

    assert (result.dispatched, result.failed) == (2, 3)
    refused = f"DispatchError: could not publish to {route.exchange.name!r}: {NACKED}"
    assert outbox(messages) == [("dispatched", 1, "")] * 2 + [("pending", 1, refused)] * 3
    assert sorted(queued(route.url, route.queues[0].name)) == sorted(
        str(message.message_id) for message in messages[:2]
    )


def published_but_unconfirmed(route, proxy, worker, timeout: float):
    """A batch of five that RabbitMQ took, through a connection that carries no confirm back."""
    register_dispatcher(TOPIC, route.dispatcher(route.proxied, timeout=timeout))
    publish(TOPIC, {"payment": "first"})
    worker(relay)  # connected, and confirmed
    queued(route.url, route.queues[0].name)
    proxy.deafen()
    return [publish(TOPIC, {"payment": n}) for n in range(5)]


def test_a_batch_whose_confirms_do_not_come_in_time_is_retried_and_none_counted_sent(
    frozen_rabbitmq, worker
):
    route, proxy = frozen_rabbitmq
    messages = published_but_unconfirmed(route, proxy, worker, timeout=1)

    result, seconds = worker(relay, random=lambda: 0.5)

    # One bound for the batch's wait, not one per message.
    assert seconds < ONE_SECOND_AND_SOME
    assert (result.dispatched, result.failed) == (0, 5)
    timed_out = (
        f"DispatchError: could not publish to {route.exchange.name!r}: no answer from the "
        "broker within 1 s (waiting for the confirms)"
    )
    assert outbox(messages) == [("pending", 1, timed_out)] * 5
    # RabbitMQ has them all: sent again, each is a duplicate the consumer drops; not one lost.
    sent = [str(message.message_id) for message in messages]
    assert sorted(queued(route.url, route.queues[0].name)) == sorted(sent)
    proxy.thaw()

    again, _ = worker(relay, now=later(3600))

    assert again.dispatched == 5
    assert {status for status, _, _ in outbox(messages)} == {"dispatched"}
    assert sorted(queued(route.url, route.queues[0].name)) == sorted(sent)


def test_a_batch_unconfirmed_when_the_relays_time_runs_out_is_given_back(frozen_rabbitmq, worker):
    route, proxy = frozen_rabbitmq
    messages = published_but_unconfirmed(route, proxy, worker, timeout=10)

    result, seconds = worker(relay, max_seconds=1)

    assert seconds < ONE_SECOND_AND_SOME
    assert (result.dispatched, result.failed, result.complete) == (0, 0, False)
    # Not sent, and not an attempt: the next relay sends them, with all their attempts left.
    assert [(status, attempts) for status, attempts, _ in outbox(messages)] == [("pending", 0)] * 5


def test_a_batch_whose_connection_drops_before_its_confirms_is_retried(frozen_rabbitmq):
    route, proxy = frozen_rabbitmq
    queue = route.queues[0]

    def relayed():
        try:
            return relay(), time.monotonic()
        finally:
            connections.close_all()

    def taken() -> bool:
        with Connection(route.url) as connection:
            declared = queue(connection.default_channel).queue_declare(passive=True)
            return declared.message_count == len(messages)

    # The thread keeps its connection from one relay to the next.
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        register_dispatcher(TOPIC, route.dispatcher(route.proxied, timeout=30))
        publish(TOPIC, {"payment": "first"})
        pool.submit(relayed).result(timeout=WAIT_AT_MOST)  # connected, and confirmed
        queued(route.url, queue.name)
        proxy.deafen()
        messages = [publish(TOPIC, {"payment": n}) for n in range(5)]
        relaying = pool.submit(relayed)
        wait_for(taken, timeout=10, interval=0.05, what="RabbitMQ to take the batch")
        cut = time.monotonic()
        proxy.cut()
        result, ended = relaying.result(timeout=WAIT_AT_MOST)
    finally:
        proxy.cut()  # a relay still waiting gives up
        pool.shutdown(wait=False, cancel_futures=True)

    assert ended - cut < ONE_SECOND_AND_SOME  # at once, not at the end of the 30 s
    assert (result.dispatched, result.failed) == (0, 5)
    for status, attempts, error in outbox(messages):
        assert (status, attempts) == ("pending", 1)
        assert "no answer" not in error, error
        assert error.endswith("(waiting for the confirms)"), error
    assert len(queued(route.url, queue.name)) == len(messages)


def test_a_message_dispatched_alone_waits_for_its_own_confirm(routes, round_trips):
    route = routes(needs("rabbitmq"), "#")
    dispatcher = route.dispatcher()
    message = a_message()

    dispatcher(message)
    dispatcher(message)

    assert round_trips.count == 2
    assert queued(route.url, route.queues[0].name) == [str(message.message_id)] * 2
