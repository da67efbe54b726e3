"""Consuming a queue through kombu, each message handled once: the inbox, fed by a broker.

A broker delivers at least once: a consumer that dies after its effect and before its
acknowledgement gets the message again. Each message is recorded in the inbox by the id its
producer set (the ``message_id`` property, never the broker's delivery tag), its handler runs
in the transaction that records it, and the message is acknowledged only once that commits. A
redelivered message that was recorded is a duplicate: acknowledged, not handled again.

A redelivery that was never recorded means that an earlier delivery died in its transaction,
perhaps in the handler: it is recorded first, in a transaction of its own, and processed as the
inbox processes any event (``INBOX_RUNNER``), so that a message which kills its consumer counts
its attempts and ends dead. A handler's failure, raised in the handler or at the COMMIT, is
retried on the inbox's schedule, by the inbox's runner, after the message was acknowledged: a
poison message never blocks its queue.

A consumer never dies of a message: whatever a producer sends is read by ``messages.read``, and
what cannot be processed is kept dead with its reason, then acknowledged. Only infrastructure
stops the flow: while the database does not answer, the consumer holds the message in hand,
takes no other, and tries it again, later and later, until the database answers; a message put
back on the queue would count a delivery each time, and a quorum queue drops a message past its
delivery limit.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager, suppress
from dataclasses import replace
from itertools import count
from typing import TYPE_CHECKING, Any

from django import db
from django.db import router, transaction

from django_idempotency import signals
from django_idempotency.backoff import exponential_bound
from django_idempotency.brokers.messages import NO_MESSAGE_ID, Delivery, kept, read
from django_idempotency.brokers.transports import (
    AMQP_SCHEMES,
    REDIS_SCHEMES,
    UnreadableItem,
    redis_transport,
    tolerant_frame_handler,
)
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import correlation, optional
from django_idempotency.core.text import mended
from django_idempotency.core.transactions import CommitWatch
from django_idempotency.inbox.processing import dispatch
from django_idempotency.inbox.receiving import Receipt, receive, record_failed_attempt, refuse
from django_idempotency.models import InboxEvent

with optional.requires("brokers", __name__):
    from kombu import Connection
    from kombu.mixins import ConsumerMixin

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from kombu import Queue
    from kombu.message import Message
    from kombu.messaging import Consumer

__all__ = ["NO_MESSAGE_ID", "MessageConsumer", "QueueRefused", "consume", "handle"]

logger = logging.getLogger("django_idempotency.brokers")

#: Seconds before the first new try of a message whose database was unavailable; the wait
#: doubles with each try, up to :data:`HOLD_MAX_DELAY`.
HOLD_DELAY = 0.5
HOLD_MAX_DELAY = 10.0
#: Seconds between two looks, on Redis, for messages whose consumer died holding them.
RESTORE_EVERY = 5.0
#: The reason of a refusal that nothing could record, for its signal and metric.
UNREADABLE = "broker.unreadable"


class QueueRefused(Exception):
    """The broker refused to declare a queue as the consumer asked: a queue of that name exists
    with other arguments, say."""


def handle(source: str, body: Any, message: Message) -> Receipt:
    """Record ``message`` in the inbox as an event of ``source``, and handle it once.

    Returns once the recording has committed: acknowledge the message then, not before. So it
    opens a transaction of its own, and refuses to run inside another. The message's own body
    is read, with every check of ``messages.read``: ``body``, what kombu decoded, is not used.
    """
    return record(source, read(message))


def record(source: str, delivery: Delivery) -> Receipt:
    """Record ``delivery`` as an event of ``source``, and handle it if it is new; commit.

    A failure of the handler, in it or at the COMMIT, is the event's failed attempt. A delivery
    that the database refuses to store is kept dead, as what can be kept of its body. Raises
    the database's error when the database is unavailable (a lock waited for too long among
    them): try the delivery again later.
    """
    using = router.db_for_write(InboxEvent)
    if delivery.refusal is not None:
        return _refuse(source, delivery, delivery.refusal, using)
    watch = CommitWatch()
    try:
        with transaction.atomic(using=using, durable=True), watch.watch(using):
            receipt = receive(
                source,
                delivery.event_id,
                delivery.event_type,
                delivery.payload,
                headers=delivery.headers,
                handle_now=not delivery.redelivered,
                wait_timeout=idempotency_settings.WAIT_TIMEOUT,
            )
    except Exception as exc:
        if watch.committed:
            # An on_commit callback of the handler's raised: the message is recorded, handled.
            logger.exception("an on_commit callback failed after message %s", delivery.event_id)
            return receipt
        if not isinstance(exc, db.DataError | db.IntegrityError):
            raise
        if watch.failed_at_commit:
            # The handler's writes broke a deferred constraint: the handler failed.
            with transaction.atomic(using=using, durable=True):
                return record_failed_attempt(
                    source,
                    delivery.event_id,
                    delivery.event_type,
                    delivery.payload,
                    exc,
                    headers=delivery.headers,
                )
        # Refused before the handler ran: what the message holds, and no delivery of it will
        # ever be recorded as it is.
        kept_delivery = replace(delivery, payload=kept(delivery.body))
        return _refuse(source, kept_delivery, f"the database refused the message: {exc}", using)
    if not receipt.created and receipt.event.status == InboxEvent.Status.RECEIVED:
        # Recorded by an earlier delivery whose consumer died before it dispatched the event:
        # this one does, rather than leave it to the periodic run.
        _dispatch(receipt.event)
    return receipt


def _refuse(source: str, delivery: Delivery, reason: str, using: str) -> Receipt:
    with transaction.atomic(using=using, durable=True):
        return refuse(
            source,
            delivery.event_type,
            delivery.payload,
            mended(reason),
            event_id=delivery.event_id,
            headers=delivery.headers,
        )


def _dispatch(event: InboxEvent) -> None:
    try:
        dispatch(event.pk)
    except db.Error:  # psycopg2's lost connection is no DatabaseError
        logger.exception("could not process inbox event %s; the periodic run will", event.pk)


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
        check_source(source)
        self.connection = connection
        self.queues = list(queues)
        self.source = source
        self.prefetch = prefetch
        self._qos: Any = None
        self._restored_at = 0.0

    def get_consumers(self, consumer: type[Consumer], channel: Any) -> list[Consumer]:
        # on_message: kombu hands over the message undecoded, and read() reads its body.
        return [
            consumer(
                queues=self.queues,
                on_message=self.on_message,
                on_decode_error=self.on_decode_error,
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

    def create_connection(self) -> Connection:
        # kombu's Redis transport fails on a list item that is no message, and py-amqp on
        # properties that are not UTF-8: these hand them on (see transports.py).
        transport = self.connection.transport_cls
        if transport in REDIS_SCHEMES:
            return self.connection.clone(transport=redis_transport())
        if transport in AMQP_SCHEMES:
            options = {**self.connection.transport_options, "frame_handler": tolerant_frame_handler}
            return self.connection.clone(transport_options=options)
        return self.connection.clone()

    @contextmanager
    def establish_connection(self) -> Iterator[Connection]:
        with self.create_connection() as connection:
            connection.ensure_connection(self.on_connection_error, None, **self.RECONNECT)
            yield connection

    def on_connection_error(self, exc: Exception, interval: float) -> None:
        if self.should_stop:
            raise exc  # stop reconnecting: run() ends
        logger.warning("broker connection lost (%s); reconnecting in %.1f s", exc, interval)

    def consume(
        self,
        limit: int | None = None,
        timeout: float | None = None,
        safety_interval: float = 1,
        **kwargs: Any,
    ) -> Iterator[None]:
        """ConsumerMixin's loop, which also survives a message the transport cannot read."""
        elapsed = 0.0
        with self.consumer_context(**kwargs) as (connection, _channel, _consumers):
            for _ in range(limit) if limit else count():
                if self.should_stop:
                    break
                self.on_iteration()
                try:
                    connection.drain_events(timeout=safety_interval)
                except TimeoutError:
                    connection.heartbeat_check()
                    elapsed += safety_interval
                    if timeout and elapsed >= timeout:
                        raise
                except OSError:
                    if not self.should_stop:
                        raise
                except UnreadableItem as exc:
                    self._keep_unreadable(json.dumps(exc.item, default=repr).encode(), exc.reason)
                except (ValueError, RecursionError) as exc:
                    # kombu's Redis transport reads a list item as JSON before any callback.
                    text = getattr(exc, "doc", None)
                    item = text.encode("utf-8", "surrogatepass") if text else None
                    self._keep_unreadable(item, f"the list item is not JSON: {exc}")
                else:
                    elapsed = 0
                    yield

    def on_message(self, message: Message) -> None:
        self._settle(message, read(message))

    def on_decode_error(self, message: Message, exc: Exception) -> None:
        """A body kombu cannot decode (or decompress) is kept dead, and acknowledged."""
        delivery = read(message)
        reason = f"the body cannot be read ({message.content_type}): {exc}"
        self._settle(message, replace(delivery, payload=kept(message.body), refusal=reason))

    def _settle(self, message: Message, delivery: Delivery) -> None:
        """Record ``delivery`` and acknowledge ``message``; hold it while the database is down."""
        with correlation.bind(correlation.from_headers(delivery.headers)):
            if self._hold(lambda: record(self.source, delivery), delivery.event_id):
                message.ack()
            else:
                message.requeue()  # asked to stop while holding it

    def _keep_unreadable(self, body: bytes | None, reason: str) -> None:
        """Keep dead, if anything of it came through, a list item that no message could be made
        of; it left the list as it was read, so there is nothing to acknowledge."""
        signals.send_robustly(
            signals.inbox_delivery_refused, type(self), source=self.source, reason=UNREADABLE
        )
        if body is None:
            logger.error("refused a message from the broker that cannot be read: %s", reason)
            return
        delivery = Delivery(
            event_id=None,
            event_type="",
            headers={},
            payload=kept(body),
            body=body,
            redelivered=False,
            refusal=reason,
        )
        if not self._hold(lambda: record(self.source, delivery), None):
            logger.error("stopped before a message that cannot be read was kept: %s", reason)

    def _hold(self, work: Callable[[], object], message_id: str | None) -> bool:
        """Run ``work`` until the database lets it finish; ``False`` if asked to stop first.

        Never raises for a message: an error that no try can mend is logged, and the message
        counted as refused.
        """
        for attempt in count(1):
            # As a request would: drop a connection that is broken or past CONN_MAX_AGE.
            db.close_old_connections()
            try:
                work()
            except (db.DataError, db.IntegrityError):
                # Even the refusal could not be kept: logged and counted, and the message is
                # done with.
                logger.exception("could not keep message %s; it is refused", message_id)
                self._count_refusal()
            except db.Error as exc:  # psycopg2's lost connection is no DatabaseError
                if self.should_stop:
                    return False
                delay = exponential_bound(attempt, HOLD_DELAY, HOLD_MAX_DELAY)
                logger.warning(
                    "could not record message %s (%s); it is held, and tried again in %.1f s",
                    message_id,
                    str(exc).strip() or type(exc).__name__,
                    delay,
                )
                with suppress(db.Error):
                    db.connections[router.db_for_write(InboxEvent)].close()
                time.sleep(delay)
                continue
            except Exception:
                # Not the database, and not the handler (its errors are the event's): a fault
                # of ours, which no try would mend. Logged and counted; the message is done with.
                logger.exception("could not record message %s; it is refused", message_id)
                self._count_refusal()
            return True
        return False  # unreachable: count() has no end

    def _count_refusal(self) -> None:
        signals.send_robustly(
            signals.inbox_delivery_refused, type(self), source=self.source, reason=UNREADABLE
        )


def check_source(source: str) -> None:
    """Refuse a source that no inbox event can be recorded as."""
    limit = InboxEvent._meta.get_field("source").max_length or 0
    if not source or len(source) > limit or "\x00" in source:
        msg = f"The source must be 1 to {limit} characters, without NUL: {source[:120]!r}"
        raise ValueError(msg)


def declare(
    url: str, queues: Sequence[Queue], options: Mapping[str, Any], stop: threading.Event
) -> None:
    """Declare ``queues`` (and their bindings) once, waiting for the broker to answer until
    ``stop`` is set; raise ``QueueRefused`` with the broker's reason if it refuses one."""

    def unreachable(exc: Exception, interval: float) -> None:
        if stop.is_set():
            raise exc
        logger.warning("the broker does not answer (%s); trying again in %.1f s", exc, interval)

    with Connection(url, transport_options=dict(options)) as connection:
        connection.ensure_connection(unreachable, **MessageConsumer.RECONNECT)
        channel = connection.default_channel
        for queue in queues:
            try:
                queue(channel).declare()
            except connection.channel_errors as exc:
                msg = f"The broker refused to declare the queue {queue.name!r}: {exc}"
                raise QueueRefused(msg) from exc


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

    Each thread has its own broker connection and its own database connection. The queues
    are declared first: ``QueueRefused`` if the broker refuses one. ``transport_options`` go
    to kombu's transport: on Redis and SQS, ``visibility_timeout`` (seconds) is how long a
    message that a consumer took and never acknowledged stays hidden before another consumer
    gets it; make it longer than the slowest handler.
    """
    check_source(source)
    options = dict(transport_options or {})
    declare(url, queues, options, stop)
    consumers = [
        MessageConsumer(
            Connection(url, transport_options=options),
            queues,
            source=source,
            prefetch=prefetch,
        )
        for _ in range(concurrency)
    ]

    failed: list[BaseException] = []

    def run(consumer: MessageConsumer) -> None:
        try:
            consumer.run()
        except BaseException as exc:
            # Not a lost connection (run() reconnects), and not a message (see _hold()): stop
            # them all, and the process, so that its supervisor starts it again.
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
