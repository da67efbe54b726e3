"""The inbox table's recording statements: an event inserted once, its duplicates counted, its
conflicts kept.

Built once per database from the model's quoted table and column names: only quoted identifiers
are interpolated, every value is a parameter. ``receiving.py`` decides; this module runs them.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from django.db import connections, models, transaction

from django_idempotency.conf import idempotency_settings
from django_idempotency.core.databases import Names
from django_idempotency.inbox.processing import CHANNEL
from django_idempotency.models import InboxEvent

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from django.db.backends.base.base import BaseDatabaseWrapper

    from django_idempotency.core.counting import Count


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


def record(
    event: InboxEvent, using: str, *, wake: bool = False, wait_timeout: float | None = None
) -> Recorded:
    """Insert ``event`` unless (source, event id) is taken; return the row that holds it.

    ``wake``: on PostgreSQL, a new event also wakes the "database" runner's workers, in the same
    statement; the notification goes out at the commit, never after a rollback. Elsewhere the
    workers poll. ``wait_timeout`` bounds MariaDB's wait for a duplicate's uncommitted row (on
    PostgreSQL the caller bounds it, see ``bounded_wait``).
    """
    connection = connections[using]
    params = _values(event, connection)
    new = Recorded(0, True, event.payload_hash, event.status)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql" and wake:
            cursor.execute(_statements(using).insert_waking, [*params, CHANNEL])
            if row := cursor.fetchone():
                return new._replace(pk=int(row[0]))
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
        # A duplicate: read the row that made the insert do nothing. A second round trip, for
        # a duplicate only: a CTE that inserted and read in one statement, its SELECT run for a
        # new event too, cost a new event 0.15 ms more than the insert alone, and saved a
        # duplicate 0.06 ms. On PostgreSQL, ON CONFLICT waited for the row if it was not
        # committed yet, and this read's snapshot, taken after, sees it.
        cursor.execute(_statements(using).select, [event.source, event.event_id])
        row = cursor.fetchone()
    if row is None:
        # The purge deleted it in between: the event is new again.
        return record(event, using, wake=wake, wait_timeout=wait_timeout)
    return Recorded(int(row[0]), False, str(row[1]), str(row[2]))


class _Statements(NamedTuple):
    insert: str
    select: str
    count_deliveries: str
    record_conflict: str
    insert_waking: str = ""  # PostgreSQL: insert, and notify the workers of a new event
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
            select=(
                f"SELECT {pk}, {payload_hash}, {status} FROM {table} WHERE {where} FOR UPDATE"  # noqa: S608
            ),
            count_deliveries=count_deliveries,
            record_conflict=record_conflict,
            insert_bounded=f"SET STATEMENT innodb_lock_wait_timeout = %s FOR {insert}",
        )

    return _Statements(
        insert=insert,
        select=f"SELECT {pk}, {payload_hash}, {status} FROM {table} WHERE {where}",  # noqa: S608
        count_deliveries=count_deliveries,
        record_conflict=record_conflict,
        # RETURNING runs for an inserted row only: a duplicate wakes nobody. pg_notify costs
        # about 0.01 ms, listened to or not: a condition on a listener would cost more.
        insert_waking=f"{insert}, pg_notify(%s, '')",
    )


def _values(event: InboxEvent, connection: BaseDatabaseWrapper) -> list[Any]:
    """The insert's values of ``event``, as its fields would prepare them for ``connection``."""
    if connection.vendor != "postgresql":
        return [
            field.get_db_prep_save(getattr(event, field.attname), connection)
            for field in map(_field, _INSERT_FIELDS)
        ]
    # On PostgreSQL, the JSON and the times as text, which the server reads as the columns'
    # types: the same values in half the time that the fields' preparation, then psycopg's
    # dumpers of a Jsonb and a datetime, took to put them in the statement.
    values = {name: getattr(event, _field(name).attname) for name in _INSERT_FIELDS}
    for name in ("payload", "headers"):
        # None is SQL NULL, as the JSONField saves it (and refused by the column).
        if values[name] is not None:
            values[name] = json.dumps(values[name])
    for name in ("received_at", "next_attempt_at"):
        if values[name] is not None:
            values[name] = _field(name).get_prep_value(values[name]).isoformat()
    return list(values.values())


@cache
def _field(name: str) -> models.Field[Any, Any]:
    return cast("models.Field[Any, Any]", InboxEvent._meta.get_field(name))


@contextmanager
def bounded_wait(using: str, seconds: float | None) -> Iterator[None]:
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


def record_conflict(delivered: InboxEvent, pk: int, using: str) -> None:
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
        bounded_wait(using, bound),
        connection.cursor() as cursor,
    ):
        cursor.execute(sql, params)


def write_deliveries(
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
