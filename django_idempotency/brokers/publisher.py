"""Publishing outbox messages to a broker's exchange, through kombu.

A message counts as sent once the broker took it for a queue. On RabbitMQ the channel is in
publisher confirm mode and every message is published *mandatory*: a message that no queue is
bound for comes back (``basic.return``, which RabbitMQ sends before its ``basic.ack``), and a
queue that cannot take it makes the broker answer ``basic.nack``; either fails the attempt, and
the outbox retries it. Redis has neither: the dispatcher reads the exchange's bindings, which
kombu keeps in Redis, before publishing, since kombu's Redis transport drops a message that
matches none.

Every wait on the broker (connecting, declaring the exchange, publishing, the confirm, closing)
is given what is left of one ``timeout`` per message, or of the relay's time when less is left
(``guard.remaining()``): a broker that stops answering costs a relay, or a request with the
inline runner, that long and no longer.

The outbox message's id travels as the AMQP ``message_id``, which a consumer dedupes on: a relay
that dies between the publish and marking the message sent publishes it again with the same id.
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
    from amqp.exceptions import MessageNacked
    from kombu import Connection, Exchange, Producer

from django_idempotency.outbox.dispatchers import DispatchError, envelope

if TYPE_CHECKING:
    from collections.abc import Callable

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
    for RabbitMQ's publisher confirm, and fail a message that no queue is bound for (without
    it, a message counts as sent once written). ``timeout``: the seconds one message may wait
    on the broker, in all. ``heartbeat``: the seconds between the heartbeats a RabbitMQ
    connection asks for (0: none). Messages are persistent.
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
        headers: dict[str, Any] = dict(message.headers)
        if self.source:
            headers[SOURCE_HEADER] = self.source
        if message.ordering_key:
            headers[ORDERING_KEY_HEADER] = message.ordering_key
        routing_key = self.routing_key(message) if self.routing_key else message.topic
        budget = _Budget(self.timeout)
        try:
            self._publish(message, routing_key, headers, budget)
        except _Unroutable as exc:
            report_unroutable(self.exchange.name, message.topic)
            msg = f"could not publish to {self.exchange.name!r}: {exc}"
            raise DispatchError(msg) from exc
        except Exception as exc:
            # Whatever went wrong, the next message starts on a new connection; this one is
            # dropped without a word to the broker, which may not be listening.
            self._drop()
            msg = f"could not publish to {self.exchange.name!r}: {budget.describe(exc)}"
            raise DispatchError(msg) from exc

    def _publish(
        self, message: OutboxMessage, routing_key: str, headers: dict[str, Any], budget: _Budget
    ) -> None:
        link = self._link(budget)
        budget.doing = "publishing"
        message_id = str(message.message_id)
        link.returned.clear()
        link.bound(budget.left())
        if link.redis and not link.routes(self.exchange, routing_key):
            msg = (
                f"no queue is bound for routing key {routing_key!r} (none of the exchange's "
                "bindings in Redis matches it)"
            )
            raise _Unroutable(msg)
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
            confirm_timeout=budget.left(),
        )
        if (returned := link.returned.pop(message_id, None)) is not None:
            msg = f"no queue is bound for routing key {routing_key!r} ({returned})"
            raise _Unroutable(msg)

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
            except Exception:  # closed since the last message: open another
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


class _Unroutable(Exception):
    """No queue takes the message: the broker returned it, or no binding matches it."""


class _Blocked(Exception):
    """RabbitMQ blocks the connection's publishes until a resource alarm clears."""


class _Budget:
    """What is left of one message's time on the broker, and what it was spent on."""

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
        if isinstance(error, MessageNacked):
            return NACKED
        if self.seconds <= 0:
            return "no time was left to publish it"
        # Every wait was given what was left: a wait that ended at the budget's end timed out,
        # whichever error the transport (or kombu, wrapping it) raised for it.
        if time.monotonic() >= self.ends:
            return f"no answer from the broker within {self.seconds:.3g} s ({self.doing})"
        return f"{error!r} ({self.doing})"


class _Link:
    """A thread's connection to the broker: its producer, and what the broker returned on it."""

    def __init__(self, url: str, seconds: float, *, confirm: bool, heartbeat: float) -> None:
        # On Redis the connection's socket timeouts bound each wait: whole seconds, so that the
        # link serves every message with as much time left, and not only the one it opened for.
        self.seconds = seconds if seconds < 1 else float(math.floor(seconds))
        self.returned: dict[str, str] = {}
        # A URL may name several brokers ("amqp://a;amqp://b"): each is given its share.
        hosts = url.count(";") + 1
        self.connection = Connection(
            url,
            connect_timeout=seconds / hosts,
            heartbeat=heartbeat,
            transport_options={
                "confirm_publish": confirm,
                "on_blocked": self._blocked,
                "socket_timeout": self.seconds,
                "socket_connect_timeout": self.seconds,
            },
        )
        self.redis = self.connection.transport.driver_type == "redis"
        self.amqp_connection: amqp.Connection | None = None
        try:
            # Each broker once, without kombu's pauses between tries: the outbox retries.
            self.connection.ensure_connection(
                max_retries=hosts - 1, interval_start=0, interval_step=0, interval_max=0
            )
            if isinstance(self.connection.connection, amqp.Connection):
                self.amqp_connection = self.connection.connection
                self.bound(seconds)
            on_return = self._returned if self.amqp_connection is not None else None
            self.producer = Producer(self.connection.default_channel, on_return=on_return)
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
        """Read what RabbitMQ sent since the last message (heartbeats, a close, a block), and
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

    def _returned(self, error: Any, exchange: str, routing_key: str, message: Any) -> None:
        message_id = message.properties.get("message_id")
        if message_id is not None:
            reason = f"{getattr(error, 'reply_code', '')} {getattr(error, 'reply_text', '')}"
            self.returned[str(message_id)] = f"the broker returned the message: {reason.strip()}"

    @staticmethod
    def _blocked(reason: str) -> None:
        # Raised in the middle of the wait for a confirm: the broker reads nothing more from
        # this connection until its alarm clears, which may take minutes.
        raise _Blocked(reason)
