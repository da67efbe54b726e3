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
import math
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
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
    fail_attempt,
    log_fields,
    process_recorded,
    report_outcome,
)
from django_idempotency.models import InboxEvent
from django_idempotency.operations import correlation
from django_idempotency.queue.schedule import RetrySchedule

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
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
    with _bounded_wait(using, wait_timeout):
        recorded = _record(event, using, wake=to_workers, wait_timeout=wait_timeout)
        if not recorded.inserted:
            return _duplicate(event, recorded, using)
    _inserted(event, recorded.pk, using)
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
    recorded = _record(event, using)
    if not recorded.inserted:
        return _duplicate(event, recorded, using)
    _inserted(event, recorded.pk, using)

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
    recorded = _record(event, using)
    if not recorded.inserted:
        return _duplicate(event, recorded, using)
    _inserted(event, recorded.pk, using)
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


def _inserted(event: InboxEvent, pk: int, using: str) -> None:
    event.pk = pk
    event._state.adding = False
    event._state.db = using


@contextmanager
def _bounded_wait(using: str, seconds: float | None) -> Iterator[None]:
    """Bound, on PostgreSQL, how long the statements in the block wait for a row lock.

    Transaction-local, and put back as it was after the block: the handler that runs next is
    not bounded. (MariaDB bounds the one statement that can wait, see ``_record``.)
    """
    connection = connections[using]
    if seconds is None or connection.vendor != "postgresql":
        yield
        return
    with connection.cursor() as cursor:
        # PostgreSQL reads a lock_timeout of 0 as "wait forever": the shortest wait is 1 ms.
        bound = f"{max(1, round(seconds * 1000))}ms"
        cursor.execute(
            "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, true)",
            [bound],
        )
        previous = cursor.fetchone()[0]
        yield
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])


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
        _record_conflict(delivered, pk, using)
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


def _record_conflict(delivered: InboxEvent, pk: int, using: str) -> None:
    """Keep, on the recorded event, the delivery of its id with another payload, and count it.

    A rare write, so not deferred like the deliveries' count: what came is kept when its
    delivery is acknowledged. Its wait for an attempt that holds the event is bounded.
    """
    connection = connections[using]
    params = [
        _field("last_conflict_at").get_db_prep_save(delivered.received_at, connection),
        _field("conflicting_payload").get_db_prep_save(delivered.payload, connection),
        delivered.payload_hash,
        pk,
    ]
    bound = idempotency_settings.WAIT_TIMEOUT
    sql = _statements(using).record_conflict
    if connection.vendor == "mysql":
        # innodb_lock_wait_timeout counts whole seconds.
        sql, params = (
            f"SET STATEMENT innodb_lock_wait_timeout = %s FOR {sql}",
            [
                math.ceil(bound),
                *params,
            ],
        )
    with (
        transaction.atomic(using=using),
        _bounded_wait(using, bound),
        connection.cursor() as cursor,
    ):
        cursor.execute(sql, params)


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


class Recorded(NamedTuple):
    """The row that holds an event: its id, whether it was inserted now, and as it was found."""

    pk: int
    inserted: bool
    payload_hash: str
    status: str


def _record(
    event: InboxEvent, using: str, *, wake: bool = False, wait_timeout: float | None = None
) -> Recorded:
    """Insert ``event`` unless (source, event id) is taken; return the row that holds it.

    ``wake``: on PostgreSQL, a new event also wakes the "database" runner's workers, in the same
    statement; the notification goes out at the commit, never after a rollback. Elsewhere the
    workers poll. ``wait_timeout`` bounds MariaDB's wait for a duplicate's uncommitted row (on
    PostgreSQL the caller bounds it, see ``_bounded_wait``).
    """
    connection = connections[using]
    params = [
        field.get_db_prep_save(getattr(event, field.attname), connection)
        for field in map(_field, _INSERT_FIELDS)
    ]
    new = Recorded(0, True, event.payload_hash, event.status)
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
                return Recorded(int(row[0]), bool(row[1]), str(row[2]), str(row[3]))
        elif connection.vendor == "mysql":
            if wait_timeout is None:
                cursor.execute(_statements(using).insert, params)
            else:
                # innodb_lock_wait_timeout counts whole seconds.
                bound = [math.ceil(wait_timeout), *params]
                cursor.execute(_statements(using).insert_bounded, bound)
            if cursor.lastrowid:  # LAST_INSERT_ID(0) marks a duplicate
                return new._replace(pk=int(cursor.lastrowid))
        else:
            cursor.execute(_statements(using).insert, params)
            if row := cursor.fetchone():
                return new._replace(pk=int(row[0]))
        # The row committed while the statement ran (ON CONFLICT waited for it): read it now.
        cursor.execute(_statements(using).select, [event.source, event.event_id])
        row = cursor.fetchone()
    if row is None:
        # The purge deleted it in between: the event is new again.
        return _record(event, using, wake=wake, wait_timeout=wait_timeout)
    return Recorded(int(row[0]), False, str(row[1]), str(row[2]))


class _Statements(NamedTuple):
    insert: str
    record: str
    select: str
    count_deliveries: str
    record_conflict: str
    record_waking: str = ""  # PostgreSQL: record, and notify the workers of a new event
    insert_bounded: str = ""  # MariaDB: insert, its wait bounded by the first parameter


@cache
def _statements(using: str) -> _Statements:
    connection = connections[using]
    c = Names(InboxEvent, connection)
    table = c.table
    columns = ", ".join(c(name) for name in _INSERT_FIELDS)
    pk, source, event_id, payload_hash, status, deliveries, last_delivered_at = (
        c(name)
        for name in (
            "id", "source", "event_id", "payload_hash", "status", "deliveries", "last_delivered_at"
        )
    )  # fmt: skip
    conflicts = c("conflicts")
    record_conflict = (
        f"UPDATE {table} SET {conflicts} = {conflicts} + 1, {c('last_conflict_at')} = %s, "  # noqa: S608
        f"{c('conflicting_payload')} = %s, {c('conflicting_payload_hash')} = %s WHERE {pk} = %s"
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
        insert = (
            f"INSERT INTO {table} ({columns}) VALUES ({values}) "  # noqa: S608
            f"ON DUPLICATE KEY UPDATE {pk} = {pk} + LAST_INSERT_ID(0)"
        )
        return _Statements(
            insert=insert,
            record="",
            select=(
                f"SELECT {pk}, {payload_hash}, {status} FROM {table} WHERE {where} FOR UPDATE"  # noqa: S608
            ),
            count_deliveries=count_deliveries,
            record_conflict=record_conflict,
            insert_bounded=f"SET STATEMENT innodb_lock_wait_timeout = %s FOR {insert}",
        )

    def record(returning: str) -> str:
        return (
            f"WITH inserted AS ({insert}, {returning}) "  # noqa: S608
            f"SELECT {pk}, TRUE, {payload_hash}, {status} FROM inserted UNION ALL "
            f"SELECT {pk}, FALSE, {payload_hash}, {status} FROM {table} WHERE {where}"
        )

    return _Statements(
        insert=insert,
        record=record(f"{payload_hash}, {status}"),
        select=f"SELECT {pk}, {payload_hash}, {status} FROM {table} WHERE {where}",  # noqa: S608
        count_deliveries=count_deliveries,
        record_conflict=record_conflict,
        # RETURNING runs for an inserted row only: a duplicate wakes nobody.
        record_waking=record(f"{payload_hash}, {status}, pg_notify(%s, '')"),
    )


def _field(name: str) -> models.Field[Any, Any]:
    return cast("models.Field[Any, Any]", InboxEvent._meta.get_field(name))
