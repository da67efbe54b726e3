"""Publishing messages in the caller's transaction, and relaying them once it commits.

A message is a row written with the caller's own changes: if the transaction rolls back, the
message was never published. The relay claims due messages in batches with
``SELECT … FOR UPDATE SKIP LOCKED``, counting the attempt and leasing the batch in a short
transaction; then it dispatches each message and marks the delivered ones. A relay that dies
before marking leaves its batch to be sent again when the lease ends, with the same message
ids. That is at-least-once delivery, which the consumer's dedupe on the message id (the
inbox's, for example) turns into once. The claim, the count of attempts, dead letters, what a
failure leaves and the locking of a redelivery come from the retry queue (``queue``), which the
inbox shares; the outbox keeps its dispatchers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django import db
from django.db import connections, router, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from django_idempotency import guard
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import correlation, task_sending
from django_idempotency.core.outcomes import report_retry, state_change
from django_idempotency.core.transactions import write_transaction
from django_idempotency.exceptions import PermanentError
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox.dispatchers import dispatch, dispatch_units
from django_idempotency.queue.attempts import (
    JobTable,
    claim,
    errors_back,
    fail,
    give_back,
    record,
)
from django_idempotency.queue.schedule import change_unclaimed, due, error_text
from django_idempotency.queue.worker import Worker

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from datetime import datetime

    from django.db.models import QuerySet

logger = logging.getLogger("django_idempotency.outbox")

Status = OutboxMessage.Status
#: The outbox's messages as the retry queue's jobs: pending during an attempt, and after one
#: that failed.
JOBS = JobTable(OutboxMessage, "OUTBOX", "relay", Status.PENDING, Status.PENDING, Status.DEAD)
#: How long an inline relay, run by the process that published, may take, and its batch size:
#: the dispatchers are told the time left (``guard.remaining()``), and a message not sent in
#: time is given back to the periodic relay.
INLINE_MAX_SECONDS = 10.0
INLINE_BATCH_SIZE = 10
#: How long a relay owns the batch it claimed: past it, the batch's messages are due again.
DEFAULT_LEASE = timedelta(minutes=5)


def publish(
    topic: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    ordering_key: str = "",
    message_id: uuid.UUID | None = None,
) -> OutboxMessage:
    """Write a message in the current transaction; it is relayed once that commits.

    Messages with the same ``ordering_key`` are dispatched one at a time, in the order they
    were published. The current correlation id goes with the message, in its
    ``X-Correlation-ID`` header, unless ``headers`` carry one.
    """
    now = timezone.now()
    headers = dict(headers or {})
    current = correlation.get_correlation_id()
    if current is not None and correlation.from_headers(headers) is None:
        headers[correlation.HEADER] = current
    message = OutboxMessage(
        message_id=message_id or uuid.uuid4(),
        topic=topic,
        payload=payload,
        headers=headers,
        ordering_key=ordering_key,
        created_at=now,
        next_attempt_at=now,
    )
    using = router.db_for_write(OutboxMessage)
    message.save(using=using, force_insert=True)
    _trigger_after_commit(using)
    return message


def _trigger_after_commit(using: str) -> None:
    connection = connections[using]
    # One trigger per transaction, however many messages it publishes: the relay takes them
    # all. (Django keeps the pending callbacks as (savepoints, callable, robust) tuples; in a
    # TestCase, callbacks already run by captureOnCommitCallbacks() stay in the list.)
    if any(
        isinstance(pending[1], _Trigger) and not pending[1].fired
        for pending in connection.run_on_commit
    ):
        return
    transaction.on_commit(_Trigger(), using=using)


class _Trigger:
    def __init__(self) -> None:
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        trigger()


def trigger() -> None:
    """Relay now, in this process (``OUTBOX_RUNNER`` "inline"), or ask a Celery worker to.

    A lost trigger is not an error: the periodic relay finds every due message.
    """
    if idempotency_settings.OUTBOX_RUNNER == "inline":
        try:
            # Bounded: the code that published waits for this; a backlog is the periodic
            # relay's work.
            relay(batch_size=INLINE_BATCH_SIZE, max_seconds=INLINE_MAX_SECONDS)
        except db.Error:  # any database failure: psycopg2's lost connection is no DatabaseError
            # What was published is committed: the periodic relay will send it.
            logger.exception("could not relay the outbox after a commit")
        return
    error = task_sending.enqueue("django_idempotency.relay_outbox")
    if error is not None:
        logger.warning("could not ask Celery to relay the outbox", exc_info=error)


@dataclass(frozen=True)
class RelayResult:
    """What one relay run did."""

    dispatched: int
    failed: int  # retried later
    dead: int
    batches: int
    seconds: float
    complete: bool  # False when the run stopped at its time limit, or was asked to stop


def relay(
    *,
    batch_size: int = 50,
    max_seconds: float | None = None,
    lease: timedelta = DEFAULT_LEASE,
    stop: Callable[[], bool] = lambda: False,
    now: Callable[[], datetime] = timezone.now,
    random: Callable[[], float] = random.random,
) -> RelayResult:
    """Dispatch the due messages, batch by batch, until none is due.

    Each batch is claimed for ``lease``: if the relay dies before it marks them, its messages
    are due again when the lease ends. ``max_seconds`` bounds the run (the next one carries
    on): dispatchers read what is left of it with ``guard.remaining()``, and a message whose
    dispatch fails once the time is up is given back, its attempt not counted. ``stop`` is
    asked before each message: once it is true, the rest of the batch is given back the same
    way. Safe in several processes at once. ``now`` and ``random`` are for tests.
    """
    using = router.db_for_write(OutboxMessage)
    started = time.monotonic()
    deadline = _deadline(started, max_seconds)

    def must_stop() -> bool:
        return (deadline is not None and time.monotonic() >= deadline) or stop()

    counts = {Status.DISPATCHED: 0, Status.PENDING: 0, Status.DEAD: 0}

    def failed(message: OutboxMessage, failure: Exception) -> None:
        counts[_record_failure(message, failure, using, now(), random)] += 1

    batches = 0
    complete = True
    while True:
        if must_stop():
            complete = False
            break
        batch, spent = _claim(using, now(), batch_size, lease)
        counts[Status.DEAD] += spent
        if not batch:
            break
        batches += 1
        # No transaction is open while the messages are sent: a slow consumer holds no lock,
        # and a consumer that writes to this database (the inbox of the same project) can.
        delivered, unsent = _send(batch, deadline, must_stop, failed)
        if unsent:
            give_back(JOBS, unsent, using, now())
            complete = False
        # One statement for the whole batch: the usual outcome is cheap. A message whose
        # lease ran out and that another relay took over is marked by that relay as well.
        counts[Status.DISPATCHED] += (
            OutboxMessage.objects.using(using)
            .filter(pk__in=[message.pk for message in delivered], status=Status.PENDING)
            .update(
                status=Status.DISPATCHED,
                next_attempt_at=None,
                dispatched_at=now(),
                **errors_back(JOBS, delivered),
            )
        )
        for message in delivered:
            message.status = Status.DISPATCHED
            _report(message, using)
        if not complete:
            break
    result = RelayResult(
        dispatched=counts[Status.DISPATCHED],
        failed=counts[Status.PENDING],
        dead=counts[Status.DEAD],
        batches=batches,
        seconds=time.monotonic() - started,
        complete=complete,
    )
    if batches:
        logger.info(
            "relayed the outbox: %d dispatched, %d to retry, %d dead",
            result.dispatched,
            result.failed,
            result.dead,
            extra={
                "idempotency_dispatched": result.dispatched,
                "idempotency_failed": result.failed,
                "idempotency_dead": result.dead,
            },
        )
    return result


def relay_worker(*, batch_size: int = 50, lease: timedelta = DEFAULT_LEASE) -> Worker[RelayResult]:
    """The long-running relay, for the retry queue's worker loop: each step relays until no
    message is due, or it is told to stop."""
    # No channel to listen on, where the inbox's workers have one: a commit that publishes
    # triggers its own relay (inline or Celery), so this one only polls for retries.
    return Worker(
        "the outbox relay",
        logger,
        lambda stop: relay(batch_size=batch_size, lease=lease, stop=stop),
        jobs="messages",
    )


def _deadline(started: float, max_seconds: float | None) -> float | None:
    """When the relay must stop (on the ``time.monotonic()`` clock): at ``max_seconds``, or
    sooner if whoever called it waits less (a request with ``Request-Timeout-Ms``)."""
    own = None if max_seconds is None else started + max_seconds
    deadlines = [end for end in (own, guard.current().deadline) if end is not None]
    return min(deadlines, default=None)


@contextlib.contextmanager
def _bounded(deadline: float | None) -> Iterator[None]:
    """Tell the dispatcher, through ``guard.remaining()``, the time the relay has left."""
    if deadline is None:
        yield
        return
    current = guard.current()
    with guard.inbound(dataclasses.replace(current, deadline=deadline)):
        yield


def _send(
    batch: list[OutboxMessage],
    deadline: float | None,
    must_stop: Callable[[], bool],
    failed: Callable[[OutboxMessage, Exception], None],
) -> tuple[list[OutboxMessage], list[OutboxMessage]]:
    """Dispatch a claimed batch, recording each failure with ``failed``; return the messages
    delivered, and those to give back: not sent before the relay had to stop."""
    delivered: list[OutboxMessage] = []
    # A dispatcher that offers dispatch_many is handed all its messages of the batch at once
    # (a broker's confirms are awaited together); any other, each message alone.
    units = dispatch_units(batch)
    for index, (dispatcher, messages) in enumerate(units):
        if must_stop():
            return delivered, [message for _, rest in units[index:] for message in rest]
        # What the dispatcher logs (the retry client's lines) carries the message's id.
        alone = correlation.from_headers(messages[0].headers) if len(messages) == 1 else None
        with correlation.bind(alone), _bounded(deadline):
            outcomes = dispatch(dispatcher, messages)
        late = []
        for message, failure in zip(messages, outcomes, strict=True):
            if failure is None:
                delivered.append(message)
            elif deadline is not None and time.monotonic() >= deadline:
                # Cut short by the relay's time, not refused: the next relay sends it, with the
                # time its dispatcher needs.
                _out_of_time(message, failure)
                late.append(message)
            else:
                failed(message, failure)
        if late:
            return delivered, late + [message for _, rest in units[index + 1 :] for message in rest]
    return delivered, []


def _out_of_time(message: OutboxMessage, failure: Exception) -> None:
    logger.warning(
        "outbox message %s was not sent before the relay's time ran out (%s); it is left to "
        "the next relay",
        message.message_id,
        error_text(failure),
        extra={
            "idempotency_message_id": str(message.message_id),
            "idempotency_topic": message.topic,
            "idempotency_outcome": "out_of_time",
            "idempotency_attempt": message.attempts,
            correlation.LOG_FIELD: correlation.from_headers(message.headers),
        },
    )


def _claim(
    using: str, now: datetime, limit: int, lease: timedelta
) -> tuple[list[OutboxMessage], int]:
    """Take up to ``limit`` due messages for ``lease``, counting the attempt; commit.

    Return them, and how many due messages were marked dead instead: their attempts ran out.
    """
    pending = OutboxMessage.objects.using(using).filter(status=Status.PENDING)
    # A message waits while an older one with its ordering key is pending, even one that
    # another relay holds or that waits for its retry.
    older = pending.filter(ordering_key=OuterRef("ordering_key"), pk__lt=OuterRef("pk")).exclude(
        ordering_key=""
    )
    claimed = claim(
        JOBS,
        due(pending, now).exclude(Exists(older)).order_by("next_attempt_at", "pk"),
        using=using,
        # A batch, where the inbox claims one event: it is sent with no transaction open, so
        # its lease, not a row lock, keeps it this relay's.
        until=lambda message: now + lease,
        limit=limit,
        on_dead=lambda message, from_state: _report(message, using),
    )
    return claimed.started, len(claimed.dead)


def _record_failure(
    message: OutboxMessage,
    failure: Exception,
    using: str,
    now: datetime,
    random: Callable[[], float],
) -> Status:
    """Schedule the message's retry, or mark it dead; return its new status."""
    # The retry counts from the failure, where the inbox's counts from its claim: until now the
    # message's next_attempt_at was its lease's end.
    fail(JOBS, message, failure, retry_from=now, random=random)
    record(JOBS, message, using, "status", "next_attempt_at", "last_error")
    _report(message, using, failure, now)
    return Status(message.status)


def _report(
    message: OutboxMessage,
    using: str,
    failure: Exception | None = None,
    now: datetime | None = None,
) -> None:
    """Log the message's new status, and report its retry, once it commits."""
    status, retry_at, error = message.status, message.next_attempt_at, message.last_error
    if status == Status.DISPATCHED and not logger.isEnabledFor(logging.INFO):
        return

    def after_commit() -> None:
        if status == Status.DISPATCHED:
            logger.info(
                "dispatched outbox message %s",
                message.message_id,
                extra=_fields(message, "dispatched", Status.DISPATCHED),
            )
        elif status == Status.DEAD:
            logger.error(
                "outbox message %s is dead after %d attempts%s: %s",
                message.message_id,
                message.attempts,
                " (a permanent failure)" if isinstance(failure, PermanentError) else "",
                error,
                extra=_fields(message, "dead", Status.DEAD),
            )
        else:
            if retry_at is not None and now is not None:
                delay = (retry_at - now).total_seconds()
                report_retry("outbox", delay, message.attempts, topic=message.topic)
            logger.warning(
                "outbox message %s failed attempt %d; retry at %s",
                message.message_id,
                message.attempts,
                retry_at,
                extra=_fields(message, "failed", Status.PENDING),
            )

    transaction.on_commit(after_commit, using=using)


def _fields(message: OutboxMessage, outcome: str, to_state: Status) -> dict[str, Any]:
    """The structured fields of a log record about ``message``, which leaves the pending state."""
    return {
        "idempotency_message_id": str(message.message_id),
        "idempotency_topic": message.topic,
        "idempotency_outcome": outcome,
        "idempotency_attempt": message.attempts,
        correlation.LOG_FIELD: correlation.from_headers(message.headers),
        **state_change(Status.PENDING, to_state),
    }


def redeliver(messages: QuerySet[OutboxMessage]) -> list[int]:
    """Dispatch ``messages`` again, whatever their status, with fresh attempts; return their ids.

    They keep their message ids, so a consumer that dedupes will not act on one it has seen.
    A message that a relay is sending at that moment may be sent twice.
    """
    using = router.db_for_write(OutboxMessage)
    fresh = {
        "status": Status.PENDING,
        "attempts": 0,
        "next_attempt_at": timezone.now(),
        "last_error": "",
    }
    with write_transaction(OutboxMessage, using):
        rows = change_unclaimed(messages.using(using), fresh, "message_id", "headers")
        if rows and logger.isEnabledFor(logging.INFO):
            transaction.on_commit(lambda: _log_redelivered(rows), using=using)
        if rows:
            _trigger_after_commit(using)
    return [row["pk"] for row in rows]


def _log_redelivered(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        logger.info(
            "outbox message %s will be delivered again",
            row["message_id"],
            extra={
                "idempotency_message_id": str(row["message_id"]),
                "idempotency_outcome": "redelivered",
                correlation.LOG_FIELD: correlation.from_headers(row["headers"]),
                **state_change(row["status"], Status.PENDING),
            },
        )
