"""Consuming a queue through kombu, each message handled once: the inbox, fed by a broker.

A broker delivers at least once: a consumer that dies after its effect and before its
acknowledgement gets the message again. Each message is recorded in the inbox by the id its
producer set (the ``message_id`` property, never the broker's delivery tag), its handler runs
in the transaction that records it, and the message is acknowledged only once that commits. A
redelivered message that was recorded is a duplicate: acknowledged, not handled again.

A redelivery that was never recorded means that an earlier delivery died in its transaction,
perhaps in the handler: it is recorded first, in a transaction of its own, and processed as the
inbox processes any event (``INBOX_RUNNER``), so that a message which kills its consumer counts
its attempts and ends dead. A handler's failure is retried on the inbox's schedule, by the
inbox's runner, after the message was acknowledged: a poison message never blocks its queue.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django import db
from django.db import router, transaction

from django_idempotency.core import optional

with optional.requires("brokers", __name__):
    from kombu import Connection
    from kombu.mixins import ConsumerMixin

from django_idempotency.inbox.receiving import Receipt, receive, refuse
from django_idempotency.models import InboxEvent
from django_idempotency.operations import correlation

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from kombu import Queue
    from kombu.message import Message
    from kombu.messaging import Consumer

logger = logging.getLogger("django_idempotency.brokers")

#: Why a message without an id is refused.
NO_MESSAGE_ID = (
    "the message has no message_id property: without the producer's id a redelivery cannot be "
    "told from a new message"
)
#: The longest message id and type an inbox event holds.
MAX_LENGTH = 255
#: Seconds before a message whose database work failed goes back to the queue.
REQUEUE_DELAY = 1.0
#: Seconds between two looks, on Redis, for messages whose consumer died holding them.
RESTORE_EVERY = 5.0


def handle(source: str, body: Any, message: Message) -> Receipt:
    """Record ``message`` in the inbox as an event of ``source``, and handle it once.

    Returns once the recording has committed: acknowledge the message then, not before.
    """
    properties = message.properties
    event_type = str(
        properties.get("type") or (message.delivery_info or {}).get("routing_key") or ""
    )
    headers = _headers(message)
    message_id = properties.get("message_id")
    redelivered = bool((message.delivery_info or {}).get("redelivered"))
    with transaction.atomic(using=router.db_for_write(InboxEvent)):
        if not message_id:
            return refuse(source, event_type[:MAX_LENGTH], body, NO_MESSAGE_ID, headers=headers)
        if len(str(message_id)) > MAX_LENGTH or len(event_type) > MAX_LENGTH:
            reason = f"the message's message_id or type is longer than {MAX_LENGTH} characters"
            return refuse(source, event_type[:MAX_LENGTH], body, reason, headers=headers)
        return receive(
            source, str(message_id), event_type, body, headers=headers, handle_now=not redelivered
        )


def _headers(message: Message) -> dict[str, str]:
    """The message's headers that an event keeps: those with a text or number value."""
    return {
        str(name): str(value)
        for name, value in (message.headers or {}).items()
        if isinstance(value, str | int | float) and not isinstance(value, bool)
    }


class MessageConsumer(ConsumerMixin):  # type: ignore[misc] # kombu is untyped
    """Consume ``queues`` on ``connection``; record and handle each message as ``source``'s.

    ``prefetch``: how many unacknowledged messages the broker hands this consumer at once.
    :meth:`run` consumes until :attr:`should_stop` is set: the message in hand is finished,
    and those prefetched go back to the queue.
    """

    #: Reconnecting: the first retry at once, then up to every two seconds.
    RECONNECT = {"interval_start": 0, "interval_step": 0.5, "interval_max": 2}

    def __init__(
        self, connection: Connection, queues: Sequence[Queue], *, source: str, prefetch: int = 10
    ) -> None:
        self.connection = connection
        self.queues = list(queues)
        self.source = source
        self.prefetch = prefetch
        self._qos: Any = None
        self._restored_at = 0.0

    def get_consumers(self, consumer: type[Consumer], channel: Any) -> list[Consumer]:
        return [
            consumer(
                queues=self.queues,
                callbacks=[self.on_message],
                accept=["json"],
                prefetch_count=self.prefetch,
            )
        ]

    def on_consume_ready(
        self, connection: Connection, channel: Any, consumers: list[Consumer], **kwargs: Any
    ) -> None:
        self._qos = getattr(channel, "qos", None)  # kombu's emulated transports have one

    def on_iteration(self) -> None:
        """On Redis, put back now and then the messages of consumers that died holding them.

        Redis knows no consumer that died: a message it handed out and that was not
        acknowledged within the transport's ``visibility_timeout`` is given to another.
        """
        restore = getattr(self._qos, "restore_visible", None)
        if restore is not None and time.monotonic() - self._restored_at >= RESTORE_EVERY:
            self._restored_at = time.monotonic()
            restore(interval=1)

    @contextmanager
    def establish_connection(self) -> Iterator[Connection]:
        with self.create_connection() as connection:
            connection.ensure_connection(self.on_connection_error, None, **self.RECONNECT)
            yield connection

    def on_connection_error(self, exc: Exception, interval: float) -> None:
        if self.should_stop:
            raise exc  # stop reconnecting: run() ends
        logger.warning("broker connection lost (%s); reconnecting in %.1f s", exc, interval)

    def on_message(self, body: Any, message: Message) -> None:
        # As a request would: drop a connection that is broken or past CONN_MAX_AGE.
        db.close_old_connections()
        try:
            with correlation.bind(correlation.from_headers(_headers(message))):
                handle(self.source, body, message)
        except (db.DataError, db.IntegrityError) as exc:
            # The database refuses what the message holds (a NUL in its JSON, say): no delivery
            # of it ever will be recorded. Kept dead, with its body's digest, and acknowledged.
            logger.exception("could not record message %s", message.properties.get("message_id"))
            self._refuse(message, f"the database refused the message: {exc}")
            return
        except db.Error:  # a lost database: psycopg2's lost connection is no DatabaseError
            logger.exception(
                "could not record message %s; it goes back to the queue",
                message.properties.get("message_id"),
            )
            time.sleep(REQUEUE_DELAY)
            message.requeue()
            return
        message.ack()

    def on_decode_error(self, message: Message, exc: Exception) -> None:
        """A body that cannot be read is kept, dead at once, and acknowledged."""
        self._refuse(message, f"the body cannot be read ({message.content_type}): {exc}")

    def _refuse(self, message: Message, reason: str) -> None:
        """Keep ``message`` dead at once, as its body's text and digest, and acknowledge it."""
        body = message.body if isinstance(message.body, bytes) else str(message.body).encode()
        payload = {
            # As text a database takes: no NUL, and not more than a person reads.
            "body": body[:10_000].decode(errors="replace").replace("\x00", "\ufffd"),
            "body_sha256": hashlib.sha256(body).hexdigest(),
        }
        event_type = str(message.properties.get("type") or "")[:MAX_LENGTH]
        with transaction.atomic(using=router.db_for_write(InboxEvent)):
            refuse(self.source, event_type, payload, reason.replace("\x00", ""))
        message.ack()


def consume(
    url: str,
    queues: Sequence[Queue],
    *,
    source: str,
    prefetch: int = 10,
    concurrency: int = 1,
    transport_options: Mapping[str, Any] | None = None,
    stop: threading.Event,
) -> None:
    """Consume ``queues`` with ``concurrency`` consumers, each in a thread of its own, until
    ``stop`` is set; each finishes the message in hand.

    Each thread has its own broker connection and its own database connection.
    ``transport_options`` go to kombu's transport: on Redis and SQS, ``visibility_timeout``
    (seconds) is how long a message that a consumer took and never acknowledged stays hidden
    before another consumer gets it; make it longer than the slowest handler.
    """
    options = dict(transport_options or {})
    consumers = [
        MessageConsumer(
            Connection(url, transport_options=options), queues, source=source, prefetch=prefetch
        )
        for _ in range(concurrency)
    ]

    failed: list[BaseException] = []

    def run(consumer: MessageConsumer) -> None:
        try:
            consumer.run()
        except BaseException as exc:
            # Not a lost connection (run() reconnects): stop them all, and the process, so that
            # its supervisor starts it again.
            logger.exception("a consumer stopped on an error; stopping the others")
            failed.append(exc)
            stop.set()
        finally:
            db.connections.close_all()

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in consumers]
    for thread in threads:
        thread.start()
    stop.wait()
    for consumer in consumers:
        consumer.should_stop = True
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
