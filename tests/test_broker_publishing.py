"""Publishing outbox messages to a broker (``BrokerDispatcher``), on a real RabbitMQ and a real
Redis: a message that no queue takes is not counted sent, a refusal says why, and no wait on the
broker outlasts the dispatcher's timeout or the time its relay has left."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta

import pytest
from django.db import connections
from django.test import override_settings
from django.utils import timezone
from kombu import Connection, Exchange, Queue, binding
from prometheus_client import REGISTRY

from django_idempotency.brokers import BrokerDispatcher
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox import DispatchError, publish, register_dispatcher, relay
from django_idempotency.outbox import relaying as outbox_relay
from django_idempotency.outbox.dispatchers import unregister
from tests.blackbox.brokers import Proxy, answers
from tests.blackbox.harness import Redis
from tests.conftest import CI

pytestmark = pytest.mark.django_db(transaction=True)

BROKERS = {
    "rabbitmq": ("amqp://guest:guest@127.0.0.1:5672//", 5672),
    "redis": (f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_CELERY_DB', '14')}", 6379),
}
TOPIC = "payment.captured"
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
    unregister(TOPIC)


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
