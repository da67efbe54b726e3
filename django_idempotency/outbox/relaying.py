"""Publishing messages in the caller's transaction, and relaying them once it commits.

A message is a row written with the caller's own changes: if the transaction rolls back, the
message was never published. The relay claims due messages in batches with
``SELECT … FOR UPDATE SKIP LOCKED``, dispatches each, and marks them in the same transaction.
A relay that dies mid-batch marks nothing: the batch is sent again, with the same message ids.
That is at-least-once delivery, which the consumer's dedupe on the message id (the inbox's, for
example) turns into once.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, router, transaction
from django.db.models import Exists, F, OuterRef
from django.utils import timezone

from django_idempotency.backoff import full_jitter
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox.dispatchers import get_dispatcher

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from datetime import datetime

    from django.db.models import QuerySet

logger = logging.getLogger("django_idempotency.outbox")

Status = OutboxMessage.Status
ERROR_MAX_LENGTH = 2_000
#: How long an inline relay, run by the process that published, may take.
INLINE_MAX_SECONDS = 10.0


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
    were published.
    """
    now = timezone.now()
    message = OutboxMessage(
        message_id=message_id or uuid.uuid4(),
        topic=topic,
        payload=payload,
        headers=dict(headers or {}),
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
    # all. (Django keeps the pending callbacks as (savepoints, callable, robust) tuples.)
    if any(pending[1] is trigger for pending in connection.run_on_commit):
        return
    transaction.on_commit(trigger, using=using)


def trigger() -> None:
    """Relay now, in this process (``OUTBOX_RUNNER`` "inline"), or ask a Celery worker to.

    A lost trigger is not an error: the periodic relay finds every due message.
    """
    if idempotency_settings.OUTBOX_RUNNER == "inline":
        # Bounded: the request that published waits for this; a backlog is the periodic
        # relay's work.
        relay(max_seconds=INLINE_MAX_SECONDS)
        return
    from django_idempotency.tasks import relay_outbox  # noqa: PLC0415 - Celery is optional

    try:
        relay_outbox.delay()
    except Exception:  # the broker's errors have no common base class
        logger.warning("could not ask Celery to relay the outbox", exc_info=True)


@dataclass(frozen=True)
class RelayResult:
    """What one relay run did."""

    dispatched: int
    failed: int  # retried later
    dead: int
    batches: int
    seconds: float
    complete: bool  # False when the run stopped at its time limit


def relay(
    *,
    batch_size: int = 50,
    max_seconds: float | None = None,
    now: Callable[[], datetime] = timezone.now,
    random: Callable[[], float] = random.random,
) -> RelayResult:
    """Dispatch the due messages, a batch per transaction, until none is due.

    ``max_seconds`` bounds the run (the next one carries on). Safe in several processes at
    once: each message of a batch is locked by the relay that claimed it. ``now`` and
    ``random`` are for tests.
    """
    using = router.db_for_write(OutboxMessage)
    started = time.monotonic()
    counts = {Status.DISPATCHED: 0, Status.PENDING: 0, Status.DEAD: 0}
    batches = 0
    complete = True
    while True:
        if max_seconds is not None and time.monotonic() - started >= max_seconds:
            complete = False
            break
        with transaction.atomic(using=using):
            batch = list(_due(using, now(), batch_size))
            delivered = []
            for message in batch:
                message.attempts += 1  # the dispatcher sees this attempt counted
                error = _dispatch(message)
                if error is None:
                    delivered.append(message.pk)
                else:
                    _record_failure(message, error, using, now(), random)
                    counts[Status(message.status)] += 1
            # One statement for the whole batch: the usual outcome is cheap.
            counts[Status.DISPATCHED] += (
                OutboxMessage.objects.using(using)
                .filter(pk__in=delivered)
                .update(
                    status=Status.DISPATCHED,
                    attempts=F("attempts") + 1,
                    next_attempt_at=None,
                    dispatched_at=now(),
                )
            )
        if not batch:
            break
        batches += 1
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


def _due(using: str, now: datetime, limit: int) -> QuerySet[OutboxMessage]:
    pending = OutboxMessage.objects.using(using).filter(status=Status.PENDING)
    # A message waits while an older one with its ordering key is pending, even one that is
    # locked by another relay or waiting for its retry.
    older = pending.filter(ordering_key=OuterRef("ordering_key"), pk__lt=OuterRef("pk")).exclude(
        ordering_key=""
    )
    return (
        pending.select_for_update(skip_locked=True)
        .filter(next_attempt_at__lte=now)
        .exclude(Exists(older))
        .order_by("next_attempt_at", "pk")[:limit]
    )


def _dispatch(message: OutboxMessage) -> str | None:
    """Dispatch one message; return why it failed, or ``None`` once it is delivered."""
    dispatcher = get_dispatcher(message.topic)
    try:
        if dispatcher is None:
            msg = f"No outbox dispatcher is registered for the topic {message.topic!r}."
            raise LookupError(msg)  # retried: a deploy may bring the dispatcher
        dispatcher(message)
    except Exception as exc:  # the dispatcher's errors are data: recorded, then retried
        return f"{type(exc).__qualname__}: {exc}"[:ERROR_MAX_LENGTH]
    return None


def _record_failure(
    message: OutboxMessage, error: str, using: str, now: datetime, random: Callable[[], float]
) -> None:
    message.last_error = error
    if message.attempts >= idempotency_settings.OUTBOX_MAX_ATTEMPTS:
        message.status, message.next_attempt_at = Status.DEAD, None
        logger.error(
            "outbox message %s is dead after %d attempts: %s",
            message.message_id,
            message.attempts,
            error,
            extra=_fields(message, "dead"),
        )
    else:
        delay = full_jitter(
            message.attempts,
            idempotency_settings.OUTBOX_RETRY_DELAY.total_seconds(),
            idempotency_settings.OUTBOX_RETRY_MAX_DELAY.total_seconds(),
            random,
        )
        message.next_attempt_at = now + timedelta(seconds=delay)
        logger.warning(
            "outbox message %s failed attempt %d; retry at %s",
            message.message_id,
            message.attempts,
            message.next_attempt_at,
            extra=_fields(message, "failed"),
        )
    message.save(using=using, update_fields=["status", "attempts", "next_attempt_at", "last_error"])


def _fields(message: OutboxMessage, outcome: str) -> dict[str, Any]:
    return {
        "idempotency_message_id": str(message.message_id),
        "idempotency_topic": message.topic,
        "idempotency_outcome": outcome,
        "idempotency_attempt": message.attempts,
    }


def redeliver(messages: QuerySet[OutboxMessage]) -> list[int]:
    """Dispatch ``messages`` again, whatever their status, with fresh attempts; return their ids.

    They keep their message ids, so a consumer that dedupes will not act on one it has seen.
    A message in a relay's batch at that moment is left alone.
    """
    using = router.db_for_write(OutboxMessage)
    with transaction.atomic(using=using):
        pks = list(
            messages.using(using).select_for_update(skip_locked=True).values_list("pk", flat=True)
        )
        OutboxMessage.objects.using(using).filter(pk__in=pks).update(
            status=Status.PENDING, attempts=0, next_attempt_at=timezone.now(), last_error=""
        )
        if pks:
            _trigger_after_commit(using)
    return pks
