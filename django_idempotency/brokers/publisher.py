"""Publishing outbox messages to a broker's exchange, through kombu.

A message counts as sent once the broker took it for a queue. On RabbitMQ the channel is in
publisher confirm mode and every message is published *mandatory*: a message that no queue is
bound for comes back (``basic.return``, which RabbitMQ sends before its ``basic.ack``), and a
queue that cannot take it makes the broker answer ``basic.nack``; either fails the attempt, and
the outbox retries it. Redis has neither: the dispatcher reads the exchange's bindings, which
kombu keeps in Redis, before publishing, since kombu's Redis transport drops a message that
matches none.

The relay hands the dispatcher its batch's messages together (``dispatch_many``): they are
published one after the other, then the confirms of them all are awaited at once, each ack or
nack matched to its message by its delivery tag and each return by its message id. That is one
wait on the broker per batch, not one per message. A message counts as sent only once its ack
came: one published but not confirmed when the wait ends (a timeout, a lost connection, a
block) fails its attempt, and is published again.

Every wait on the broker (connecting, declaring the exchange, publishing, the confirms, closing)
is given what is left of one ``timeout`` per batch, or of the relay's time when less is left
(``guard.remaining()``): a broker that stops answering costs a relay, or a request with the
inline runner, that long and no longer.

The outbox message's id travels as the AMQP ``message_id``, which a consumer dedupes on: a relay
that dies between the publish and marking the message sent, or a message whose confirm did not
come in time, is published again with the same id.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import TYPE_CHECKING, Any

from django_idempotency import guard
from django_idempotency.core import optional
from django_idempotency.core.outcomes import report_unroutable

with optional.requires("brokers", __name__):
    import amqp
    from kombu import Connection, Exchange, Producer

from django_idempotency.outbox.dispatchers import DispatchError, envelope

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from django_idempotency.models import OutboxMessage

#: The header that carries a message's ordering key.
ORDERING_KEY_HEADER = "ordering-key"
#: The header that names the publishing service.
SOURCE_HEADER = "source"

NACKED = (
    "the broker refused the message (basic.nack): a queue it was routed to rejects publishes "
    "(full, with x-overflow reject-publish) or could not store it"
)
BLOCKED = (
    "the broker blocks publishing (connection.blocked): one of its resource alarms (memory, "
    "disk) is on"
)


class BrokerDispatcher:
    """Publish each message to ``exchange`` on the broker at ``url``, as its envelope in JSON.

    The routing key is the message's topic, unless ``routing_key`` (a callable of the message)
    says otherwise; the ordering key goes in the ``ordering-key`` header. Headers: the
    message's own (its correlation id among them) and ``source``, when given. ``confirm``: wait
    for RabbitMQ's publisher confirms, and fail a message that no queue is bound for (without
    it, a message counts as sent once written). ``timeout``: the seconds one batch of messages
    (one message, called alone) may wait on the broker, in all. ``heartbeat``: the seconds
    between the heartbeats a RabbitMQ connection asks for (0: none). Messages are persistent.
    """

    def __init__(
        self,
        url: str | Callable[[], str],
        exchange: str | Exchange,
        *,
        exchange_type: str = "topic",
        routing_key: Callable[[OutboxMessage], str] | None = None,
        source: str = "",
        confirm: bool = True,
        timeout: float = 10.0,
        heartbeat: float = 60.0,
    ) -> None:
        self.url = url
        self.exchange = (
            exchange
            if isinstance(exchange, Exchange)
            else Exchange(exchange, type=exchange_type, durable=True)
        )
        self.routing_key = routing_key
        self.source = source
        self.confirm = confirm
        self.timeout = timeout
        self.heartbeat = heartbeat
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"BrokerDispatcher({self.exchange.name!r})"

    def __call__(self, message: OutboxMessage) -> None:
        (failure,) = self.dispatch_many([message])
        if failure is not None:
            raise failure

    def dispatch_many(self, messages: Sequence[OutboxMessage]) -> list[Exception | None]:
        """Publish ``messages``, then wait for the broker's confirms of them all at once; return,
        for each, the error that fails its attempt, or ``None`` once a queue took it."""
        budget = _Budget(self.timeout)
        batch = _Batch()
        error: Exception | None = None
        try:
            link = self._link(budget)
            budget.doing = "publishing"
            link.begin(batch, budget.left())
            for message in messages:
                self._publish(link, message, budget)
            budget.doing = "waiting for the confirms"
            link.settle(budget)
        except Exception as exc:
            # Whatever went wrong, the next batch starts on a new connection; this one is
            # dropped without a word to the broker, which may not be listening.
            self._drop()
            error = exc
        return [self._outcome(message, batch, budget, error) for message in messages]

    def _publish(self, link: _Link, message: OutboxMessage, budget: _Budget) -> None:
        message_id = str(message.message_id)
        routing_key = self.routing_key(message) if self.routing_key else message.topic
        if link.redis and not link.routes(self.exchange, routing_key):
            link.batch.returned[message_id] = (
                f"no queue is bound for routing key {routing_key!r} (none of the exchange's "
                "bindings in Redis matches it)"
            )
            return
        headers: dict[str, Any] = dict(message.headers)
        if self.source:
            headers[SOURCE_HEADER] = self.source
        if message.ordering_key:
            headers[ORDERING_KEY_HEADER] = message.ordering_key
        link.producer.publish(
            envelope(message),
            exchange=self.exchange,
            routing_key=routing_key,
            serializer="json",
            message_id=message_id,
            type=message.topic,
            headers=headers,
            delivery_mode=2,
            declare=[self.exchange],
            # With confirms, RabbitMQ returns a message no queue takes before it acks it.
            mandatory=self.confirm,
            timeout=budget.left(),
        )
        link.sent(message_id)

    def _outcome(
        self, message: OutboxMessage, batch: _Batch, budget: _Budget, error: Exception | None
    ) -> Exception | None:
        message_id = str(message.message_id)
        # A return comes before the ack of its message: an acked message that was returned is
        # one that no queue took.
        if (returned := batch.returned.get(message_id)) is not None:
            report_unroutable(self.exchange.name, message.topic)
            reason = returned
        elif message_id in batch.nacked:
            reason = NACKED
        elif message_id in batch.acked:
            return None
        elif error is not None:  # not confirmed when the batch failed: sent again, never lost
            reason = budget.describe(error)
        else:
            reason = "the broker did not confirm it"
        failure = DispatchError(f"could not publish to {self.exchange.name!r}: {reason}")
        failure.__cause__ = error
        return failure

    def _link(self, budget: _Budget) -> _Link:
        # One connection per thread: kombu's connections are not to be shared between threads.
        link: _Link | None = getattr(self._local, "link", None)
        if link is not None and not link.fits(budget):
            self._drop()
            link = None
        if link is not None:
            try:
                link.check(budget.left())
            except _Blocked:
                raise
            except Exception:  # closed since the last batch: open another
                self._drop()
                link = None
        if link is None:
            budget.doing = "connecting"
            url = self.url() if callable(self.url) else self.url
            link = _Link(url, budget.left(), confirm=self.confirm, heartbeat=self.heartbeat)
            self._local.link = link
        return link

    def _drop(self) -> None:
        link: _Link | None = self._local.__dict__.pop("link", None)
        if link is not None:
            link.drop()

    def close(self) -> None:
        """Close this thread's connection, waiting at most ``timeout`` for the broker; the
        next publish opens another."""
        link: _Link | None = self._local.__dict__.pop("link", None)
        if link is not None:
            link.close(self.timeout)


class _Blocked(Exception):
    """RabbitMQ blocks the connection's publishes until a resource alarm clears."""


class _Budget:
    """What is left of one batch's time on the broker, and what it was spent on."""

    def __init__(self, timeout: float) -> None:
        left = guard.remaining()
        self.seconds = timeout if left is None else min(timeout, left)
        self.ends = time.monotonic() + self.seconds
        self.doing = "connecting"

    def left(self) -> float:
        left = self.ends - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def describe(self, error: Exception) -> str:
        if isinstance(error, _Blocked):
            return BLOCKED
        if self.seconds <= 0:
            return "no time was left to publish it"
        # Every wait was given what was left: a wait that ended at the budget's end timed out,
        # whichever error the transport (or kombu, wrapping it) raised for it.
        if time.monotonic() >= self.ends:
            return f"no answer from the broker within {self.seconds:.3g} s ({self.doing})"
        return f"{error!r} ({self.doing})"


class _Batch:
    """What the broker said of one batch's messages, by message id."""

    def __init__(self) -> None:
        self.unconfirmed: dict[int, str] = {}  # by delivery tag, in the order published
        self.acked: set[str] = set()
        self.nacked: set[str] = set()
        self.returned: dict[str, str] = {}  # why no queue takes it

    def settle(self, tag: int, multiple: bool, into: set[str]) -> None:
        """Count the messages an ack or a nack of ``tag`` answers (``multiple``: every one up
        to it) as ``into`` says."""
        if not multiple:
            if (message_id := self.unconfirmed.pop(tag, None)) is not None:
                into.add(message_id)
            return
        for earlier in list(self.unconfirmed):
            if earlier > tag:
                break
            into.add(self.unconfirmed.pop(earlier))


class _Link:
    """A thread's connection to the broker: its producer, and the batch it publishes."""

    def __init__(self, url: str, seconds: float, *, confirm: bool, heartbeat: float) -> None:
        # On Redis the connection's socket timeouts bound each wait: whole seconds, so that the
        # link serves every batch with as much time left, and not only the one it opened for.
        self.seconds = seconds if seconds < 1 else float(math.floor(seconds))
        self.batch = _Batch()
        # The delivery tag of the channel's last publish: RabbitMQ numbers them from 1 on.
        self.tag = 0
        # A URL may name several brokers ("amqp://a;amqp://b"): each is given its share.
        hosts = url.count(";") + 1
        self.connection = Connection(
            url,
            connect_timeout=seconds / hosts,
            heartbeat=heartbeat,
            transport_options={
                # Not py-amqp's confirm_publish, which waits for each message's confirm.
                "on_blocked": self._blocked,
                "socket_timeout": self.seconds,
                "socket_connect_timeout": self.seconds,
            },
        )
        self.redis = self.connection.transport.driver_type == "redis"
        self.amqp_connection: amqp.Connection | None = None
        self.confirms = False
        try:
            # Each broker once, without kombu's pauses between tries: the outbox retries.
            self.connection.ensure_connection(
                max_retries=hosts - 1, interval_start=0, interval_step=0, interval_max=0
            )
            channel = self.connection.default_channel
            if isinstance(self.connection.connection, amqp.Connection):
                self.amqp_connection = self.connection.connection
                self.bound(seconds)
                self.confirms = confirm
                if confirm:
                    channel.events["basic_ack"].add(self._acked)
                    channel.events["basic_nack"].add(self._nacked)
                    channel.confirm_select()
            on_return = self._returned if self.amqp_connection is not None else None
            self.producer = Producer(channel, on_return=on_return)
        except BaseException:
            self.drop()
            raise

    def fits(self, budget: _Budget) -> bool:
        """Whether every wait on this link ends within ``budget``."""
        return self.amqp_connection is not None or self.seconds <= budget.seconds

    def bound(self, seconds: float) -> None:
        """Make every wait on RabbitMQ's socket end within ``seconds``."""
        if self.amqp_connection is not None:
            self.amqp_connection.sock.settimeout(seconds)

    def check(self, seconds: float) -> None:
        """Read what RabbitMQ sent since the last batch (heartbeats, a close, a block), and
        send a heartbeat if one is due: raise if the connection is gone."""
        if self.amqp_connection is None:
            return
        self.bound(seconds)
        while True:
            try:
                self.amqp_connection.drain_events(timeout=0)
            except TimeoutError:  # nothing more to read
                break
        self.amqp_connection.heartbeat_tick()

    def begin(self, batch: _Batch, seconds: float) -> None:
        """Publish ``batch`` next, each wait ending within ``seconds``."""
        self.batch = batch
        self.bound(seconds)

    def sent(self, message_id: str) -> None:
        """The message is written: sent, or awaiting its confirm."""
        if not self.confirms:
            self.batch.acked.add(message_id)
            return
        self.tag += 1
        self.batch.unconfirmed[self.tag] = message_id

    def settle(self, budget: _Budget) -> None:
        """Read what RabbitMQ answers until every message of the batch is confirmed (acks,
        nacks and the returns before them), within ``budget``."""
        while self.batch.unconfirmed and self.amqp_connection is not None:
            self.amqp_connection.drain_events(timeout=budget.left())

    def routes(self, exchange: Exchange, routing_key: str) -> bool:
        """Whether one of the bindings Redis keeps for ``exchange`` matches ``routing_key``."""
        channel = self.producer.channel
        kind = channel.typeof(exchange.name, default=exchange.type)
        return bool(kind.lookup(channel.get_table(exchange.name), exchange.name, routing_key, None))

    def drop(self) -> None:
        """Forget the connection without waiting for the broker."""
        with contextlib.suppress(Exception):
            self.connection.collect()

    def close(self, seconds: float) -> None:
        """Close the connection, waiting at most ``seconds`` for the broker."""
        with contextlib.suppress(Exception):
            if self.amqp_connection is None:
                self.connection.release()
            elif self.connection.connected:
                self.bound(seconds)
                # The broker closes the channel with its connection: one wait, not two.
                self.amqp_connection.close()
        self.drop()

    def _acked(self, tag: int, multiple: bool) -> None:
        self.batch.settle(tag, multiple, self.batch.acked)

    def _nacked(self, tag: int, multiple: bool) -> None:
        self.batch.settle(tag, multiple, self.batch.nacked)

    def _returned(self, error: Any, exchange: str, routing_key: str, message: Any) -> None:
        message_id = message.properties.get("message_id")
        if message_id is not None:
            reason = f"{getattr(error, 'reply_code', '')} {getattr(error, 'reply_text', '')}"
            self.batch.returned[str(message_id)] = (
                f"no queue is bound for routing key {routing_key!r} (the broker returned the "
                f"message: {reason.strip()})"
            )

    @staticmethod
    def _blocked(reason: str) -> None:
        # Raised in the middle of a wait (a publish reads what the broker sent, too): the
        # broker reads nothing more from this connection until its alarm clears, which may
        # take minutes.
        raise _Blocked(reason)
