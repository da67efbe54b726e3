"""Publishing outbox messages to a broker's exchange, through kombu.

A message counts as sent once the broker confirmed it: on RabbitMQ the channel is in publisher
confirm mode, so a publish returns only after the broker took responsibility for the message
(a refusal raises, and the outbox retries). The outbox message's id travels as the AMQP
``message_id``, which a consumer dedupes on: a relay that dies between the publish and marking
the message sent publishes it again with the same id.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from django_idempotency.core import optional

with optional.requires("brokers", __name__):
    from kombu import Connection, Exchange, Producer

from django_idempotency.outbox.dispatchers import DispatchError, envelope

if TYPE_CHECKING:
    from collections.abc import Callable

    from django_idempotency.models import OutboxMessage

#: The header that carries a message's ordering key.
ORDERING_KEY_HEADER = "ordering-key"
#: The header that names the publishing service.
SOURCE_HEADER = "source"


class BrokerDispatcher:
    """Publish each message to ``exchange`` on the broker at ``url``, as its envelope in JSON.

    The routing key is the message's topic, unless ``routing_key`` (a callable of the message)
    says otherwise; the ordering key goes in the ``ordering-key`` header. Headers: the
    message's own (its correlation id among them) and ``source``, when given. ``confirm``: wait
    for RabbitMQ's publisher confirm (transports without confirms, Redis among them, count a
    message sent once written). Messages are persistent.
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
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"BrokerDispatcher({self.exchange.name!r})"

    def __call__(self, message: OutboxMessage) -> None:
        headers: dict[str, Any] = dict(message.headers)
        if self.source:
            headers[SOURCE_HEADER] = self.source
        if message.ordering_key:
            headers[ORDERING_KEY_HEADER] = message.ordering_key
        producer = self.producer
        try:
            producer.publish(
                envelope(message),
                exchange=self.exchange,
                routing_key=self.routing_key(message) if self.routing_key else message.topic,
                serializer="json",
                message_id=str(message.message_id),
                type=message.topic,
                headers=headers,
                delivery_mode=2,
                declare=[self.exchange],
                retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5},
                timeout=self.timeout,
                confirm_timeout=self.timeout,
            )
        except Exception as exc:
            # Whatever went wrong, the next message starts on a new connection.
            self.close()
            msg = f"could not publish to {self.exchange.name!r}: {exc!r}"
            raise DispatchError(msg) from exc

    @property
    def producer(self) -> Producer:
        # One connection per thread: kombu's connections are not to be shared between threads.
        producer: Producer | None = getattr(self._local, "producer", None)
        if producer is None:
            url = self.url() if callable(self.url) else self.url
            options = {"confirm_publish": True} if self.confirm else {}
            connection = Connection(url, transport_options=options, connect_timeout=self.timeout)
            producer = Producer(connection)
            self._local.connection, self._local.producer = connection, producer
        return producer

    def close(self) -> None:
        """Close this thread's connection; the next publish opens another."""
        connection = getattr(self._local, "connection", None)
        self._local.connection = self._local.producer = None
        if connection is not None:
            # A connection that broke may fail to close too.
            with contextlib.suppress(Exception):
                connection.release()
