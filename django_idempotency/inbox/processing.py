"""Processing each recorded inbox event once: dispatching it, running its handler, retrying it.

Processing takes two short transactions. The first claims the event (``SELECT … FOR UPDATE
SKIP LOCKED``), marks it processing, counts the attempt and sets when the event is due again
should this attempt never finish. The second locks the event again, runs the handler in a
savepoint and records the outcome, so that the handler's writes and the new status commit
together. Counting the attempt before the handler runs means that a handler which kills its
worker every time still ends dead; the row lock, held for the whole attempt, tells a live
attempt from a dead one with no timeout to tune. The claim, the count of attempts, dead
letters, what a failure leaves and the locking of a person's actions come from the retry queue
(``queue``), which the outbox shares; the inbox keeps its handlers.

Celery, when used, is only the trigger: the schedule lives in ``next_attempt_at``, and the
periodic :func:`dispatch_due` finds every event whose trigger was lost or whose retry is due.
With the "database" runner there is no trigger at all: a recorded event is due at once, and
workers (``manage.py idempotency_inbox --forever``) take due events in batches with
:func:`process_due`, woken on PostgreSQL by a notification on :data:`CHANNEL`.
"""

from __future__ import annotations

import logging
import random
import time
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from django import db
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router, transaction
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import correlation, task_sending
from django_idempotency.core.outcomes import report_retry, state_change
from django_idempotency.core.transactions import CommitWatch, write_transaction
from django_idempotency.inbox.handlers import get_handler, handles_source
from django_idempotency.models import InboxEvent
from django_idempotency.queue.attempts import (
    JobTable,
    claim,
    count_attempt,
    fail,
    record,
)
from django_idempotency.queue.schedule import change_unclaimed, due

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from django.db.models import QuerySet

logger = logging.getLogger("django_idempotency.inbox")

Status = InboxEvent.Status

#: How long a recorded or re-dispatched event waits for its processing to start before the
#: periodic run dispatches it again (its trigger was lost, or is still queued).
DISPATCH_GRACE = timedelta(minutes=1)
#: The PostgreSQL channel on which recording an event wakes the "database" runner's workers.
CHANNEL = "django_idempotency_inbox"


#: The inbox's events as the retry queue's jobs: processing during an attempt, failed after one.
JOBS = JobTable(InboxEvent, "INBOX", "worker", Status.PROCESSING, Status.FAILED, Status.DEAD)
# What an attempt's outcome changes.
_OUTCOME_FIELDS = ["status", "next_attempt_at", "processed_at", "last_error", "last_traceback"]


class ProcessResult(StrEnum):
    """What one call to :func:`process` did."""

    PROCESSED = "processed"
    FAILED = "failed"  # retried at next_attempt_at
    DEAD = "dead"
    SKIPPED = "skipped"  # already processed or dead, or another attempt has it


def dispatch(pk: int) -> ProcessResult | None:
    """Process event ``pk`` now, or hand it to a Celery worker; ``None`` when handed over.

    ``INBOX_RUNNER`` decides: "celery" hands it over, "inline" and "database" process it here.
    A lost hand-over is not an error: the event stays due, and the periodic
    :func:`dispatch_due` dispatches it again.
    """
    if idempotency_settings.INBOX_RUNNER != "celery":
        return process(pk)
    error = task_sending.enqueue("django_idempotency.process_inbox_event", pk)
    if error is not None:
        logger.warning(
            "could not hand inbox event %d to Celery; it will be dispatched again",
            pk,
            exc_info=error,
        )
    return None


def dispatch_due(*, now: datetime | None = None, limit: int = 500) -> int:
    """Dispatch up to ``limit`` events that are due; return how many.

    Due are failed events whose retry time has come, and recorded or processing events whose
    trigger was lost or whose worker died. Safe in several processes at once.
    """
    pks, _ = _take_due(now or timezone.now(), limit, router.db_for_write(InboxEvent))
    for pk in pks:
        dispatch(pk)
    return len(pks)


def process_due(
    *, limit: int = 50, stop: Callable[[], bool] = lambda: False, now: datetime | None = None
) -> int:
    """Take up to ``limit`` due events, oldest first, and process them here; return how many.

    ``stop`` is asked before each event: once it is true, the events not begun are left due
    at once, for another worker. Safe in several processes at once.
    """
    now = now or timezone.now()
    using = router.db_for_write(InboxEvent)
    pks, taken_until = _take_due(now, limit, using)
    for index, pk in enumerate(pks):
        if stop():
            rest = InboxEvent.objects.using(using).filter(pk__in=pks[index:])
            # Unless something else has rescheduled them since.
            rest.filter(next_attempt_at=taken_until).update(next_attempt_at=now)
            break
        process(pk)
    return len(pks)


def _take_due(now: datetime, limit: int, using: str) -> tuple[list[int], datetime]:
    """Take up to ``limit`` due events; return their ids and when they stop being ours.

    Taking an event is not yet an attempt: :func:`process` claims it again by its id, and
    counts the attempt then.
    """
    events = InboxEvent.objects.using(using)
    taken_until = now + DISPATCH_GRACE
    with write_transaction(InboxEvent, using):
        taken = due(events, now).order_by("next_attempt_at")
        pks = list(taken.values_list("pk", flat=True)[:limit])
        # Not due again until its attempt starts: a second run, or a worker's long queue, does
        # not dispatch it twice.
        events.filter(pk__in=pks).update(next_attempt_at=taken_until)
    return pks, taken_until


def wake_workers(using: str) -> None:
    """On PostgreSQL, wake the "database" runner's workers once the transaction commits.

    Elsewhere they poll. PostgreSQL delivers one notification per transaction however many
    identical ones it sent.
    """
    connection = connections[using]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])


def process(
    pk: int, *, now: datetime | None = None, random: Callable[[], float] = random.random
) -> ProcessResult:
    """Attempt to process event ``pk``: claim it, run its handler, record the outcome.

    ``random`` draws the retry delay's jitter; tests pass their own.
    """
    using = router.db_for_write(InboxEvent)
    claimed = _claim(pk, using, now or timezone.now(), random)
    if isinstance(claimed, ProcessResult):
        return claimed
    return _attempt(claimed, using)


def _claim(
    pk: int, using: str, now: datetime, random: Callable[[], float]
) -> InboxEvent | ProcessResult:
    """Claim event ``pk`` for one attempt and count it; or return why it is not attempted.

    One event by its id, due or not, where the outbox claims due batches: a trigger names it.
    """
    events = InboxEvent.objects.using(using)
    claimed = claim(
        JOBS,
        events.filter(pk=pk, status__in=(Status.RECEIVED, Status.FAILED, Status.PROCESSING)),
        using=using,
        # Due again at its retry time should this attempt never finish; a failure keeps it.
        until=lambda event: now + timedelta(seconds=_retry_delay(event, random)),
        # A locked event that no attempt has started is no live attempt to step aside for: a
        # duplicate delivery holds it for a moment.
        waiting=events.filter(pk=pk, status=Status.RECEIVED) if _duplicates_lock(using) else None,
        starting=_log_start,
        on_dead=lambda event, from_state: report_outcome(
            event, ProcessResult.DEAD, None, using, from_state=from_state
        ),
    )
    if claimed.dead:
        return ProcessResult.DEAD
    return claimed.started[0] if claimed.started else ProcessResult.SKIPPED


def _retry_delay(event: InboxEvent, random: Callable[[], float]) -> float:
    return JOBS.schedule().retry_delay(event.attempts, random)


def _log_start(event: InboxEvent) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "attempt %d of inbox event %s starts",
            event.attempts + 1,
            event.event_id,
            extra={
                **log_fields(event, "processing"),
                **state_change(event.status, Status.PROCESSING),
            },
        )


def process_recorded(
    event: InboxEvent, using: str, *, now: datetime, random: Callable[[], float] = random.random
) -> ProcessResult:
    """Attempt ``event`` in the transaction that has just recorded it (a broker consumer's).

    That transaction holds the new row's lock, and no one else sees the row before it
    commits: the attempt is counted and the handler run at once, and the outcome commits
    with the record, or neither does. A failure is retried on the inbox's schedule.
    """
    count_attempt(JOBS, event, lambda event: now + timedelta(seconds=_retry_delay(event, random)))
    event.save(update_fields=["status", "attempts", "next_attempt_at"])
    with correlation.bind(correlation.from_headers(event.headers)):
        return _run_handler(event, using)


def _attempt(event: InboxEvent, using: str) -> ProcessResult:
    watch, retry_at = CommitWatch(), event.next_attempt_at
    # The handler's log records, and ours, carry the id the event was delivered with.
    with correlation.bind(correlation.from_headers(event.headers)):
        try:
            with write_transaction(InboxEvent, using), watch.watch(using):
                mine = (
                    InboxEvent.objects.using(using)
                    # The lock is this attempt's sign of life. Where duplicate deliveries lock
                    # the row for a moment, wait instead of skipping: a worker that took the
                    # event over has counted another attempt, and the filter then finds nothing.
                    .select_for_update(skip_locked=not _duplicates_lock(using))
                    .filter(pk=event.pk, status=Status.PROCESSING, attempts=event.attempts)
                )
                if not mine.exists():
                    # Between our two transactions another worker took the event over.
                    return ProcessResult.SKIPPED
                return _run_handler(event, using)
        except (db.DataError, db.IntegrityError) as exc:
            if not watch.failed_at_commit:
                raise
            event.next_attempt_at = retry_at  # as the claim set it
            return _failed_at_commit(event, exc, using)


def _failed_at_commit(event: InboxEvent, error: Exception, using: str) -> ProcessResult:
    """Record that the attempt's COMMIT refused the handler's writes (a deferred constraint):
    a failure of the handler like any other, in a transaction of its own."""
    outcome = fail_attempt(event, error)
    with write_transaction(InboxEvent, using):
        record(JOBS, event, using, *_OUTCOME_FIELDS)
        report_outcome(event, outcome, error, using)
    return outcome


def _run_handler(event: InboxEvent, using: str) -> ProcessResult:
    """Run the handler in a savepoint of the attempt's transaction, and record the outcome."""
    handler = get_handler(event.source, event.event_type)
    started = time.monotonic()
    error: Exception | None = None
    try:
        with transaction.atomic(using=using):
            if handler is not None:
                handler(event)
                if transaction.get_rollback(using=using):
                    raise HandlerRolledBack
            elif not handles_source(event.source):
                # Most likely the handlers' module was not imported in this process: fail, so
                # that the event is retried, rather than lose it as processed.
                raise ImproperlyConfigured(_no_handlers(event.source))
    except Exception as exc:  # the handler's errors are data: recorded, then retried
        error = exc
        outcome = fail_attempt(event, exc)
    else:
        outcome = ProcessResult.PROCESSED
        event.status, event.next_attempt_at = Status.PROCESSED, None
        event.processed_at = timezone.now()
    event.save(update_fields=_OUTCOME_FIELDS)
    report_outcome(event, outcome, error, using, time.monotonic() - started)
    return outcome


class HandlerRolledBack(Exception):
    """The handler returned with its transaction marked for rollback: its writes are undone."""

    def __init__(self) -> None:
        super().__init__(
            "the handler returned with its transaction marked for rollback (by "
            "transaction.set_rollback(True), or by a database error caught outside an inner "
            "atomic block), so its writes were undone"
        )


def fail_attempt(event: InboxEvent, error: Exception) -> ProcessResult:
    """Set on ``event`` what its attempt that failed with ``error`` leaves; return the outcome.

    Failed, due again at the retry time its claim set; or dead, once its attempts ran out or
    the handler raised a ``PermanentError``.
    """
    dead = fail(JOBS, event, error)
    event.processed_at = None
    return ProcessResult.DEAD if dead else ProcessResult.FAILED


def _duplicates_lock(using: str) -> bool:
    """Whether a duplicate delivery locks the event's row while it is recorded (see receiving).

    MariaDB's insert locks the row it finds; PostgreSQL's ON CONFLICT DO NOTHING does not.
    """
    return connections[using].vendor == "mysql"


def _no_handlers(source: str) -> str:
    return (
        f"No inbox handler is registered for {source!r} events. Import the module that "
        "defines them in an AppConfig.ready()."
    )


_SIGNALS = {
    ProcessResult.PROCESSED: signals.inbox_event_processed,
    ProcessResult.FAILED: signals.inbox_event_failed,
    ProcessResult.DEAD: signals.inbox_event_dead,
}


def report_outcome(
    event: InboxEvent,
    outcome: ProcessResult,
    error: Exception | None,
    using: str,
    duration: float | None = None,
    *,
    from_state: str = Status.PROCESSING,
) -> None:
    """Log the outcome and send its signal once the transaction that recorded it commits."""

    def after_commit() -> None:
        fields = {
            **log_fields(event, outcome.value),
            "idempotency_duration": duration,
            **state_change(from_state, event.status),
        }
        if outcome is ProcessResult.FAILED and event.next_attempt_at is not None:
            delay = (event.next_attempt_at - timezone.now()).total_seconds()
            report_retry("inbox", delay, event.attempts, source=event.source)
        if outcome is ProcessResult.PROCESSED:
            logger.info("processed inbox event %s", event.event_id, extra=fields)
        elif outcome is ProcessResult.FAILED:
            logger.warning(
                "inbox event %s failed attempt %d; retry at %s",
                event.event_id,
                event.attempts,
                event.next_attempt_at,
                extra=fields,
            )
        else:
            logger.error(
                "inbox event %s is dead after %d attempts",
                event.event_id,
                event.attempts,
                extra=fields,
            )
        kwargs: dict[str, Any] = {"event": event}
        if outcome is not ProcessResult.PROCESSED:
            kwargs["error"] = error
        signals.send_robustly(_SIGNALS[outcome], InboxEvent, **kwargs)

    transaction.on_commit(after_commit, using=using)


def log_fields(event: InboxEvent, outcome: str) -> dict[str, Any]:
    """The structured fields of every inbox log record about ``event``."""
    # A duplicate's recorded event is loaded without its headers: reading them would cost a
    # query, and the delivery's own id (bound by the middleware, if any) is the one to log.
    headers = event.__dict__.get("headers")
    return {
        "idempotency_source": event.source,
        "idempotency_event_id": event.event_id,
        "idempotency_event_type": event.event_type,
        "idempotency_outcome": outcome,
        "idempotency_attempt": event.attempts,
        correlation.LOG_FIELD: correlation.from_headers(headers)
        or correlation.get_correlation_id(),
    }


# What the log record of a person's action shows of each event it changed.
_ACTION_LOG_FIELDS = ("source", "event_id", "headers")


def reprocess(events: QuerySet[InboxEvent]) -> list[int]:
    """Process ``events`` again from a clean slate, whatever their status; return their ids.

    Their attempts start again from zero. An event mid-attempt is left alone.
    """
    return _redispatch(events, reset=True)


def retry_now(events: QuerySet[InboxEvent]) -> list[int]:
    """Dispatch the failed among ``events`` now, not at their retry time; return their ids."""
    return _redispatch(events.filter(status=Status.FAILED), reset=False)


def mark_dead(events: QuerySet[InboxEvent]) -> list[int]:
    """Stop retrying the unprocessed among ``events``; return their ids."""
    using = router.db_for_write(InboxEvent)
    unprocessed = events.using(using).exclude(status__in=(Status.PROCESSED, Status.DEAD))
    with write_transaction(InboxEvent, using):
        rows = change_unclaimed(
            unprocessed, {"status": Status.DEAD, "next_attempt_at": None}, *_ACTION_LOG_FIELDS
        )
        _log_changes(rows, Status.DEAD, using)
    return [row["pk"] for row in rows]


def _redispatch(events: QuerySet[InboxEvent], *, reset: bool) -> list[int]:
    using = router.db_for_write(InboxEvent)
    now = timezone.now()
    # The "database" runner's workers take the events, due at once, rather than this process.
    to_workers = idempotency_settings.INBOX_RUNNER == "database"
    changes: dict[str, Any] = {"next_attempt_at": now if to_workers else now + DISPATCH_GRACE}
    if reset:
        changes.update(status=Status.RECEIVED, attempts=0, processed_at=None)
    with write_transaction(InboxEvent, using):
        rows = change_unclaimed(events.using(using), changes, *_ACTION_LOG_FIELDS)
        if reset:
            _log_changes(rows, Status.RECEIVED, using)
        pks = [row["pk"] for row in rows]
        if to_workers:
            if pks:
                wake_workers(using)
            return pks
        for pk in pks:
            transaction.on_commit(lambda pk=pk: dispatch(pk), using=using)  # type: ignore[misc] # default binds the loop value
    return pks


def _log_changes(rows: list[dict[str, Any]], to_state: Status, using: str) -> None:
    """Log the state change of each event that a person's action changed, once it commits."""

    def after_commit() -> None:
        for row in rows:
            logger.info(
                "inbox event %s from %s is now %s",
                row["event_id"],
                row["source"],
                to_state,
                extra={
                    "idempotency_source": row["source"],
                    "idempotency_event_id": row["event_id"],
                    "idempotency_outcome": to_state.value,
                    correlation.LOG_FIELD: correlation.from_headers(row["headers"]),
                    **state_change(row["status"], to_state),
                },
            )

    if rows and logger.isEnabledFor(logging.INFO):
        transaction.on_commit(after_commit, using=using)
