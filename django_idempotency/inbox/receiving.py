"""Recording a delivered inbox event once, however often it is delivered.

Recording is one ``INSERT … ON CONFLICT DO NOTHING`` on (source, event id) (on MariaDB, an
``INSERT … ON DUPLICATE KEY UPDATE`` that changes nothing): the unique index is the only arbiter
between duplicate deliveries. A duplicate is not recorded or dispatched again, and writes
nothing: its delivery is counted in memory and added to the event about a second later
(``counting.py``), so it never waits for an attempt at processing the event. A new event is
dispatched (see ``processing``) once the caller's transaction commits, unless the "database"
runner's workers are to take it: then recording is all the request does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from django import db
from django.db import connections, models, router, transaction
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import idempotency_settings
from django_idempotency.core import canonical
from django_idempotency.core.counting import Count, DeferredCounts
from django_idempotency.core.databases import Names
from django_idempotency.exceptions import PermanentError
from django_idempotency.inbox.processing import (
    CHANNEL,
    DISPATCH_GRACE,
    ProcessResult,
    dispatch,
    log_fields,
    process_recorded,
)
from django_idempotency.models import InboxEvent
from django_idempotency.operations import correlation

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
) -> Receipt:
    """Record an event once, and dispatch it when the caller's transaction commits.

    An ``event_id`` of ``None`` dedupes the event by its payload hash. A duplicate is not
    recorded or dispatched again. With the "database" runner the event is left, due at once,
    to the workers. ``handle_now`` processes a new event here instead, in the caller's
    transaction: its handler's writes commit with the record, or neither does (a broker
    consumer's way, which acknowledges the message once that commits).
    """
    now = now or timezone.now()
    to_workers = idempotency_settings.INBOX_RUNNER == "database" and not handle_now
    using = router.db_for_write(InboxEvent)
    if handle_now and not connections[using].in_atomic_block:
        msg = "receive(handle_now=True) runs in the caller's transaction: open one."
        raise transaction.TransactionManagementError(msg)
    digest = payload_hash(payload)
    event = InboxEvent(
        source=source,
        event_id=event_id if event_id is not None else f"sha256:{digest}",
        event_type=event_type,
        payload=payload,
        payload_hash=digest,
        # An id that a request could not carry either is dropped, as the middleware ignores it:
        # the event's handlers would log it and send it on.
        headers=correlation.without_invalid(headers or {}),
        received_at=now,
        # Due at once for the workers; otherwise due only if the dispatch after the commit is lost.
        next_attempt_at=now if to_workers else now + DISPATCH_GRACE,
    )
    pk, inserted, recorded_hash = _record(event, using, wake=to_workers)
    if not inserted:
        return _duplicate(event, pk, recorded_hash, using)
    event.pk = pk
    event._state.adding = False
    event._state.db = using
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
    headers: Mapping[str, str] | None = None,
    now: datetime | None = None,
) -> Receipt:
    """Record an event that cannot be processed, dead at once with ``reason``.

    Such an event (a broker message without an id, or one whose body cannot be read or stored)
    has no id to trust: it is recorded once by its payload hash, and never processed. A person
    reads the reason in the admin, and may reprocess it.
    """
    digest = payload_hash(payload)
    event = InboxEvent(
        source=source,
        event_id=f"sha256:{digest}",
        event_type=event_type,
        payload=payload,
        payload_hash=digest,
        headers=correlation.without_invalid(headers or {}),
        received_at=now or timezone.now(),
        status=InboxEvent.Status.DEAD,
        next_attempt_at=None,
        last_error=reason,
    )
    using = router.db_for_write(InboxEvent)
    pk, inserted, recorded_hash = _record(event, using)
    if not inserted:
        return _duplicate(event, pk, recorded_hash, using)
    event.pk = pk
    event._state.adding = False
    event._state.db = using

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


def _duplicate(delivered: InboxEvent, pk: int, recorded_hash: str, using: str) -> Receipt:
    # The recorded event, its other fields loaded when first read.
    recorded = InboxEvent.from_db(
        using,
        ["id", "source", "event_id", "payload_hash"],
        [pk, delivered.source, delivered.event_id, recorded_hash],
    )
    conflict = recorded_hash != delivered.payload_hash
    if conflict:
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


def _write_deliveries(
    model: type[models.Model], using: str, counts: Mapping[tuple[int, int], Count]
) -> None:
    """Add duplicate deliveries counted in memory to their events, in one transaction."""
    connection = connections[using]
    at = _field("last_delivered_at")
    params = [
        [count.times, *[at.get_db_prep_save(count.last_at, connection)] * 2, pk]
        for (pk, _version), count in sorted(counts.items())  # in id order: no deadlocks
    ]
    with transaction.atomic(using=using), connection.cursor() as cursor:
        cursor.executemany(_statements(using).count_deliveries, params)


# This process's duplicate deliveries, written to their events about a second later: a duplicate
# writes nothing, so it never waits for an attempt at processing its event.
delivery_counts = DeferredCounts(_write_deliveries)


_INSERT_FIELDS = (
    "source",
    "event_id",
    "event_type",
    "payload",
    "payload_hash",
    "headers",
    "status",
    "attempts",
    "received_at",
    "deliveries",
    "next_attempt_at",
    "last_error",
    "last_traceback",
)


def _record(event: InboxEvent, using: str, *, wake: bool = False) -> tuple[int, bool, str]:
    """Insert ``event`` unless (source, event id) is taken.

    Return the id of the row that holds the event, whether it was inserted now, and the
    payload hash it was recorded with. ``wake``: on PostgreSQL, a new event also wakes the
    "database" runner's workers, in the same statement; the notification goes out at the commit,
    never after a rollback. Elsewhere the workers poll.
    """
    connection = connections[using]
    params = [
        field.get_db_prep_save(getattr(event, field.attname), connection)
        for field in map(_field, _INSERT_FIELDS)
    ]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # One round trip for a duplicate too: the SELECT reads the row that made the
            # INSERT do nothing, if that row had committed when the statement began.
            if wake:
                sql, params = _statements(using).record_waking, [*params, CHANNEL]
            else:
                sql = _statements(using).record
            cursor.execute(sql, [*params, event.source, event.event_id])
            if row := cursor.fetchone():
                return int(row[0]), bool(row[1]), str(row[2])
        elif connection.vendor == "mysql":
            cursor.execute(_statements(using).insert, params)
            if cursor.lastrowid:  # LAST_INSERT_ID(0) marks a duplicate
                return int(cursor.lastrowid), True, event.payload_hash
        else:
            cursor.execute(_statements(using).insert, params)
            if row := cursor.fetchone():
                return int(row[0]), True, event.payload_hash
        # The row committed while the statement ran (ON CONFLICT waited for it): read it now.
        cursor.execute(_statements(using).select, [event.source, event.event_id])
        row = cursor.fetchone()
    if row is None:
        # The purge deleted it in between: the event is new again.
        return _record(event, using, wake=wake)
    return int(row[0]), False, str(row[1])


class _Statements(NamedTuple):
    insert: str
    record: str
    select: str
    count_deliveries: str
    record_waking: str = ""  # PostgreSQL: record, and notify the workers of a new event


@cache
def _statements(using: str) -> _Statements:
    connection = connections[using]
    c = Names(InboxEvent, connection)
    table = c.table
    columns = ", ".join(c(name) for name in _INSERT_FIELDS)
    pk, source, event_id, payload_hash, deliveries, last_delivered_at = (
        c(name)
        for name in ("id", "source", "event_id", "payload_hash", "deliveries", "last_delivered_at")
    )
    count_deliveries = (
        f"UPDATE {table} SET {deliveries} = {deliveries} + %s, "  # noqa: S608
        f"{last_delivered_at} = CASE WHEN {last_delivered_at} IS NULL "
        f"OR {last_delivered_at} < %s THEN %s ELSE {last_delivered_at} END WHERE {pk} = %s"
    )
    # ON CONFLICT DO NOTHING rather than catching IntegrityError: no error, so no savepoint is
    # needed inside a caller's transaction, and a duplicate costs no aborted insert.
    insert = (
        f"INSERT INTO {table} ({columns}) VALUES ({', '.join(['%s'] * len(_INSERT_FIELDS))}) "  # noqa: S608
        f"ON CONFLICT ({source}, {event_id}) DO NOTHING RETURNING {pk}"
    )
    where = f"{source} = %s AND {event_id} = %s"
    if connection.vendor == "mysql":
        # The duplicate's row is locked by the insert already: the locking read waits for
        # nothing, and sees the row however old the transaction's snapshot.
        values = ", ".join(["%s"] * len(_INSERT_FIELDS))
        return _Statements(
            insert=(
                f"INSERT INTO {table} ({columns}) VALUES ({values}) "  # noqa: S608
                f"ON DUPLICATE KEY UPDATE {pk} = {pk} + LAST_INSERT_ID(0)"
            ),
            record="",
            select=f"SELECT {pk}, {payload_hash} FROM {table} WHERE {where} FOR UPDATE",  # noqa: S608
            count_deliveries=count_deliveries,
        )

    def record(returning: str) -> str:
        return (
            f"WITH inserted AS ({insert}, {returning}) "  # noqa: S608
            f"SELECT {pk}, TRUE, {payload_hash} FROM inserted UNION ALL "
            f"SELECT {pk}, FALSE, {payload_hash} FROM {table} WHERE {where}"
        )

    return _Statements(
        insert=insert,
        record=record(payload_hash),
        select=f"SELECT {pk}, {payload_hash} FROM {table} WHERE {where}",  # noqa: S608
        count_deliveries=count_deliveries,
        # RETURNING runs for an inserted row only: a duplicate wakes nobody.
        record_waking=record(f"{payload_hash}, pg_notify(%s, '')"),
    )


def _field(name: str) -> models.Field[Any, Any]:
    return cast("models.Field[Any, Any]", InboxEvent._meta.get_field(name))
