"""Recording a delivered inbox event once, however often it is delivered.

Recording is one ``INSERT … ON CONFLICT DO NOTHING`` on (source, event id) (on MariaDB, an
``INSERT … ON DUPLICATE KEY UPDATE`` that changes nothing): the unique index is the only arbiter
between duplicate deliveries. A duplicate is not recorded or dispatched again, and writes
nothing: its delivery is counted in memory and added to the event about a second later
(``counting.py``), so it never waits for an attempt at processing the event; only a duplicate with
another payload writes at once, to keep it as the event's conflict. A new event is dispatched (see
``processing``) once the caller's transaction commits, unless the "database" runner's workers are
to take it: then recording is all the request does. The statements are in ``statements.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django import db
from django.db import connections, router, transaction
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import canonical, correlation
from django_idempotency.core.counting import DeferredCounts
from django_idempotency.exceptions import PermanentError
from django_idempotency.inbox.processing import (
    DISPATCH_GRACE,
    ProcessResult,
    dispatch,
    fail_attempt,
    log_fields,
    process_recorded,
    report_outcome,
)
from django_idempotency.inbox.statements import (
    Recorded,
    bounded_wait,
    record,
    record_conflict,
    write_deliveries,
)
from django_idempotency.models import InboxEvent
from django_idempotency.queue.schedule import RetrySchedule

if TYPE_CHECKING:
    from collections.abc import Mapping
    from datetime import datetime

logger = logging.getLogger("django_idempotency.inbox")


@dataclass
class Receipt:
    """What :func:`receive` did with a delivery."""

    event: InboxEvent
    created: bool  # False: a duplicate, recorded before
    conflict: bool = False  # a duplicate whose payload differs from the recorded one
    # Set when the event was processed in this thread as the recording committed.
    outcome: ProcessResult | None = None


def payload_hash(payload: Any) -> str:
    """SHA-256 of ``payload``'s canonical JSON, so key order does not matter."""
    return canonical.sha256(payload)


def receive(
    source: str,
    event_id: str | None,
    event_type: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    now: datetime | None = None,
    handle_now: bool = False,
    wait_timeout: float | None = None,
) -> Receipt:
    """Record an event once, and dispatch it when the caller's transaction commits.

    An ``event_id`` of ``None`` dedupes the event by its payload hash. A duplicate is not
    recorded or dispatched again. With the "database" runner the event is left, due at once,
    to the workers. ``handle_now`` processes a new event here instead, in the caller's
    transaction: its handler's writes commit with the record, or neither does (a broker
    consumer's way, which acknowledges the message once that commits). ``wait_timeout``
    bounds, in seconds, the wait for a duplicate's uncommitted record (another consumer's,
    mid-handler); past it the database's lock timeout error is raised.
    """
    now = now or timezone.now()
    to_workers = idempotency_settings.INBOX_RUNNER == "database" and not handle_now
    using = router.db_for_write(InboxEvent)
    if handle_now and not connections[using].in_atomic_block:
        msg = "receive(handle_now=True) runs in the caller's transaction: open one."
        raise transaction.TransactionManagementError(msg)
    event = _new_event(
        source,
        event_id,
        event_type,
        payload,
        headers=headers,
        now=now,
        # Due at once for the workers; else due only if the dispatch after the commit is lost.
        next_attempt_at=now if to_workers else now + DISPATCH_GRACE,
    )
    with bounded_wait(using, wait_timeout):
        duplicate = _insert(event, using, wake=to_workers, wait_timeout=wait_timeout)
    if duplicate is not None:
        return duplicate
    receipt = Receipt(event, created=True)
    if handle_now:
        receipt.outcome = process_recorded(event, using, now=now)

    def after_commit() -> None:
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "recorded inbox event %s from %s",
                event.event_id,
                source,
                extra=log_fields(event, "received"),
            )
        signals.send_robustly(signals.inbox_event_received, InboxEvent, event=event)
        if to_workers or handle_now:
            return
        try:
            receipt.outcome = dispatch(event.pk)
        except db.Error:  # any database failure: psycopg2's lost connection is no DatabaseError
            # The event is recorded: the periodic run will process it.
            logger.exception("could not process inbox event %s", event.event_id)
            receipt.outcome = ProcessResult.FAILED

    transaction.on_commit(after_commit, using=using)
    return receipt


def refuse(
    source: str,
    event_type: str,
    payload: Any,
    reason: str,
    *,
    event_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> Receipt:
    """Record an event that cannot be processed, dead at once with ``reason``.

    Such an event (a broker message without an id, or one whose body cannot be read or stored)
    is recorded once by its ``event_id``, or by its payload hash when it has no id to trust, and
    never processed. A person reads the reason in the admin, and may reprocess it.
    """
    event = _new_event(
        source,
        event_id,
        event_type,
        payload,
        headers=headers,
        now=now or timezone.now(),
        status=InboxEvent.Status.DEAD,
        next_attempt_at=None,
        last_error=reason,
    )
    using = router.db_for_write(InboxEvent)
    if (duplicate := _insert(event, using)) is not None:
        return duplicate

    def after_commit() -> None:
        logger.error(
            "refused inbox event %s from %s: %s",
            event.event_id,
            source,
            reason,
            extra=log_fields(event, "dead"),
        )
        signals.send_robustly(
            signals.inbox_event_dead, InboxEvent, event=event, error=PermanentError(reason)
        )

    transaction.on_commit(after_commit, using=using)
    return Receipt(event, created=True, outcome=ProcessResult.DEAD)


def record_failed_attempt(
    source: str,
    event_id: str | None,
    event_type: str,
    payload: Any,
    error: Exception,
    *,
    headers: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> Receipt:
    """Record an event whose first attempt failed where no savepoint could catch the failure:
    the COMMIT of the transaction that recorded it refused its handler's writes.

    The event keeps its id and payload, its attempt counted and failed with ``error``: retried
    on the inbox's schedule, or dead if that gives up.
    """
    now = now or timezone.now()
    delay = RetrySchedule.from_settings("INBOX").retry_delay(1)
    event = _new_event(
        source,
        event_id,
        event_type,
        payload,
        headers=headers,
        now=now,
        attempts=1,
        next_attempt_at=now + timedelta(seconds=delay),
    )
    outcome = fail_attempt(event, error)
    using = router.db_for_write(InboxEvent)
    if (duplicate := _insert(event, using)) is not None:
        return duplicate
    report_outcome(event, outcome, error, using, from_state=InboxEvent.Status.RECEIVED)
    return Receipt(event, created=True, outcome=outcome)


def _new_event(
    source: str,
    event_id: str | None,
    event_type: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None,
    now: datetime,
    **fields: Any,
) -> InboxEvent:
    digest = payload_hash(payload)
    return InboxEvent(
        source=source,
        event_id=event_id if event_id is not None else f"sha256:{digest}",
        event_type=event_type,
        payload=payload,
        payload_hash=digest,
        # An id that a request could not carry either is dropped, as the middleware ignores it:
        # the event's handlers would log it and send it on.
        headers=correlation.without_invalid(headers or {}),
        received_at=now,
        **fields,
    )


def _insert(event: InboxEvent, using: str, **options: Any) -> Receipt | None:
    """Insert ``event``, which then is its row; or return the receipt of a duplicate, if its
    (source, event id) is taken. ``options`` go to ``statements.record``."""
    recorded = record(event, using, **options)
    if not recorded.inserted:
        return _duplicate(event, recorded, using)
    event.pk = recorded.pk
    event._state.adding = False
    event._state.db = using
    return None


def _duplicate(delivered: InboxEvent, found: Recorded, using: str) -> Receipt:
    pk = found.pk
    # The recorded event, its other fields loaded when first read.
    recorded = InboxEvent.from_db(
        using,
        ["id", "source", "event_id", "payload_hash", "status"],
        [pk, delivered.source, delivered.event_id, found.payload_hash, found.status],
    )
    conflict = found.payload_hash != delivered.payload_hash
    if conflict:
        record_conflict(delivered, pk, using)
        logger.warning(
            "inbox event %s from %s delivered again with a different payload; kept the first",
            recorded.event_id,
            recorded.source,
            extra=log_fields(recorded, "conflict"),
        )
    elif logger.isEnabledFor(logging.INFO):
        logger.info(
            "inbox event %s from %s delivered again",
            recorded.event_id,
            recorded.source,
            extra=log_fields(recorded, "duplicate"),
        )
    delivery_counts.add(InboxEvent, using, pk, 0, delivered.received_at)
    transaction.on_commit(
        lambda: signals.send_robustly(
            signals.inbox_event_duplicate, InboxEvent, event=recorded, conflict=conflict
        ),
        using=using,
    )
    return Receipt(recorded, created=False, conflict=conflict)


# This process's duplicate deliveries, written to their events about a second later: a duplicate
# writes nothing, so it never waits for an attempt at processing its event.
delivery_counts = DeferredCounts(write_deliveries)
