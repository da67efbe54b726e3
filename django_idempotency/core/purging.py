"""Deleting rows that are done with, in short batches: expired keys, processed events, dispatched
messages.

One routine for the three tables. It walks the primary key from the lowest to the highest id of
the rows done with at the start, ``batch_size`` ids at a time, and each batch is a range delete
that commits on its own, so that no batch holds its locks for long and a purge can run beside
the traffic. Several purges at once are safe: a row that another holds (another purge's batch, or a
request taking an expired key over) is left for the next run rather than waited for.

Our own DELETE, not ``QuerySet.delete()``: Django's collector would load every row into Python
as soon as a project connects a ``post_delete`` receiver to the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db import OperationalError, connections, models, router, transaction

from django_idempotency.core.databases import (
    Names,
    again_after_deadlocks,
    is_lock_timeout,
    placeholders,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import datetime

    from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger("django_idempotency")

# How long a batch waits for a row that another transaction holds before it leaves that batch's
# locked rows for the next run: PostgreSQL's, then MariaDB's in whole seconds.
LOCK_TIMEOUT = "100ms"
LOCK_WAIT = 1


@dataclass(frozen=True)
class PurgeResult:
    """What one purge run did."""

    deleted: int
    batches: int
    seconds: float
    longest_batch: float  # seconds: the longest that one batch's transaction took
    complete: bool  # False when the run stopped at its time limit


class Done(NamedTuple):
    """Which rows are done with: ``field`` compares with ``value`` by ``op`` (``<`` or ``<=``),
    and ``status`` (a field name and its value), if given, matches."""

    field: str
    op: str
    value: datetime
    status: tuple[str, str] | None = None


def delete_in_batches(
    model: type[models.Model],
    done: Done,
    *,
    batch_size: int,
    pause: float | None = None,
    max_seconds: float | None = None,
) -> PurgeResult:
    """Delete ``model``'s rows that ``done`` matches, ``batch_size`` ids at a time.

    After each batch the run sleeps ``pause`` seconds, by default as long as the batch took, so
    that the traffic beside it has at least half of the database's time; ``max_seconds`` bounds
    the run (the next run carries on). Call it outside a transaction.
    """
    batch = _Batch(model, connections[router.db_for_write(model)], done)
    started = time.monotonic()
    # The walk spans only the rows done with when it starts: the rows a person must see (a dead
    # event, say) may be years older, and a walk from them would never reach the newest.
    span = batch.span()
    deleted = batches = 0
    longest = 0.0
    complete = True
    if span is not None:
        first, last = span
        for low in range(first, last + 1, batch_size):
            if max_seconds is not None and time.monotonic() - started >= max_seconds:
                complete = False
                break
            batch_started = time.monotonic()
            deleted += batch.delete(low, low + batch_size)
            took = time.monotonic() - batch_started
            longest = max(longest, took)
            batches += 1
            time.sleep(took if pause is None else pause)
    result = PurgeResult(deleted, batches, time.monotonic() - started, longest, complete)
    logger.info(
        "purged %d %s in %d batches (%.3f s)%s",
        result.deleted,
        model._meta.verbose_name_plural,
        result.batches,
        result.seconds,
        "" if complete else "; stopped at the time limit",
        extra={"idempotency_purged": result.deleted, "idempotency_batches": result.batches},
    )
    return result


class _Statements(NamedTuple):
    # The lowest and the highest id of the rows done with.
    span: str
    # A plain range delete, which waits a moment at most for a row another transaction holds.
    bounded: str
    # Past that moment: PostgreSQL deletes the rows it can lock; MariaDB picks them, then
    # deletes them by id ("{ids}"); SQLite, whose writers take turns, never gets here.
    skip_locked: str = ""
    picked: str = ""


@cache
def _statements(
    model: type[models.Model], using: str, field: str, op: str, status: str | None
) -> _Statements:
    connection = connections[using]
    vendor = connection.vendor
    c = Names(model, connection)
    t = c.table
    done = f"{c(field)} {op} %s"
    if status is not None:
        done += f" AND {c(status)} = %s"
    where = f"{c('id')} >= %s AND {c('id')} < %s AND {done}"
    span = f"SELECT MIN({c('id')}), MAX({c('id')}) FROM {t} WHERE {done}"  # noqa: S608
    if vendor == "sqlite":
        return _Statements(span, f"DELETE FROM {t} WHERE {where}")  # noqa: S608
    if vendor == "postgresql":
        # Left to itself, PostgreSQL finds MAX(id) by walking the primary key down from the
        # newest row until one is done with: through every live row of the table, since ids and
        # expiry times grow together. OFFSET 0 keeps the subquery apart, so that it reads the
        # rows done with, by their own index, and no others.
        return _Statements(
            span=(
                f"SELECT MIN({c('id')}), MAX({c('id')}) FROM "  # noqa: S608
                f"(SELECT {c('id')} FROM {t} WHERE {done} OFFSET 0) AS done"
            ),
            # The CTE sets the bound before any row is locked.
            bounded=(
                "WITH bounded AS (SELECT set_config('lock_timeout', %s, true)) "  # noqa: S608
                f"DELETE FROM {t} WHERE {where} AND EXISTS (SELECT FROM bounded)"
            ),
            skip_locked=(
                f"DELETE FROM {t} WHERE {c('id')} IN (SELECT {c('id')} FROM {t} "  # noqa: S608
                f"WHERE {where} FOR UPDATE SKIP LOCKED)"
            ),
        )
    # MariaDB refuses a LIMIT in an IN subquery and a subquery on the table a statement changes.
    # The batches walk the primary key, and only it: left to choose, the optimizer may scan
    # another index instead, locking the entries of rows that another batch holds, and two
    # batches then deadlock. A list of a thousand ids or more it would turn into a join (on a
    # scan of the whole index) unless told not to. Skipping locked rows is the second choice
    # here: MariaDB's SKIP LOCKED can skip a row whose holder then rolls back (a deadlock), so
    # two purges at once would each leave it.
    primary = "FORCE INDEX (PRIMARY)"
    return _Statements(
        span=span,
        bounded=(
            "SET STATEMENT innodb_lock_wait_timeout = %s FOR "
            f"DELETE {t} FROM {t} {primary} WHERE {where}"
        ),
        skip_locked=f"SELECT {c('id')} FROM {t} {primary} WHERE {where} FOR UPDATE SKIP LOCKED",  # noqa: S608
        picked=(
            "SET STATEMENT in_predicate_conversion_threshold = 0 FOR "
            f"DELETE {t} FROM {t} {primary} WHERE {c('id')} IN ({{ids}})"
        ),
    )


class _Batch:
    """One table's batch delete on one database."""

    def __init__(
        self, model: type[models.Model], connection: BaseDatabaseWrapper, done: Done
    ) -> None:
        self.connection = connection
        status = None if done.status is None else done.status[0]
        self.sql = _statements(model, connection.alias, done.field, done.op, status)
        field = model._meta.get_field(done.field)
        cutoff = field.get_db_prep_value(done.value, connection)  # type: ignore[union-attr] # a concrete field
        self.where = [cutoff] if done.status is None else [cutoff, done.status[1]]

    def span(self) -> tuple[int, int] | None:
        """The lowest and the highest id of the rows done with; ``None`` if there are none."""
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.span, self.where)
            low, high = cursor.fetchone()
        return None if low is None else (low, high)

    def delete(self, low: int, high: int) -> int:
        """Delete the batch's rows with ``low <= id < high``, in a transaction of their own."""
        params = [low, high, *self.where]
        vendor = self.connection.vendor
        if vendor == "sqlite":
            return self._run(self.sql.bounded, params)
        wait = LOCK_TIMEOUT if vendor == "postgresql" else LOCK_WAIT

        def delete() -> int:
            try:
                return self._run(self.sql.bounded, [wait, *params])
            except OperationalError as exc:
                if not is_lock_timeout(exc):
                    raise
            return self._run(self.sql.skip_locked, params, then=self.sql.picked)

        return again_after_deadlocks(delete, self.connection)

    def _run(self, sql: str, params: Sequence[Any], then: str = "") -> int:
        with transaction.atomic(using=self.connection.alias), self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            if not then:
                return int(cursor.rowcount)
            picked = [row[0] for row in cursor.fetchall()]
            if picked:
                cursor.execute(then.format(ids=placeholders(picked)), picked)
            return len(picked)
