"""Counts kept in memory and written to their rows about a second later, in one transaction.

A replay answers from one read of its key's row, and a duplicate webhook delivery from the
insert that found its event recorded: neither writes, so neither waits for a row lock or for the
disk. The admin still shows how often a key was replayed, and an event delivered, and when last:
each process counts them here, and a timer thread writes them about a second after the first
one since the last write. A process that dies loses the counts of its last second, never a
stored response or an event.

A count is kept by row id and row version (a key's lease version): a key taken over meanwhile,
by a new request after it expired, starts its count afresh.

On an in-memory SQLite database (a test database) a count is written at once, in the thread that
counted it. Threads share such a database through SQLite's shared cache, which refuses a second
writer at once instead of making it wait: a timer thread writing there could make a test's own
statements fail.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from django import db
from django.db import connections

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from datetime import datetime

    from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper
    from django.db.models import Model

    # The rows of one table on one database.
    Rows = tuple[type[Model], str]

logger = logging.getLogger("django_idempotency")

# How long a count may wait in memory before it is written.
FLUSH_DELAY = 1.0


@dataclass
class Count:
    """What was counted of one row since the last write, and the time of the last one."""

    times: int
    last_at: datetime


class DeferredCounts:
    """This process's counts not yet written, by table, database alias and (row id, row version).

    ``write(model, using, counts)`` writes one table's counts on one database in one transaction.
    """

    def __init__(
        self,
        write: Callable[[type[Model], str, Mapping[tuple[int, int], Count]], None],
        delay: float = FLUSH_DELAY,
    ) -> None:
        self.write = write
        self.delay = delay
        self._pending: dict[Rows, dict[tuple[int, int], Count]] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def add(self, model: type[Model], using: str, row_id: int, version: int, at: datetime) -> int:
        """Count one more of ``model``'s row ``row_id`` (at ``version``) at ``at``, to be
        written within ``delay``.

        Return how many of that row this process counted since its last write.
        """
        if _shared_in_memory(using):
            self._write((model, using), {(row_id, version): Count(1, at)})
            return 1
        with self._lock:
            rows = self._pending.setdefault((model, using), {})
            count = rows.get((row_id, version))
            if count is None:
                count = rows[(row_id, version)] = Count(0, at)
            count.times += 1
            count.last_at = max(count.last_at, at)
            if self._timer is None:
                self._timer = threading.Timer(self.delay, self._flush_in_background)
                self._timer.daemon = True
                self._timer.start()
            return count.times

    def discard(self) -> None:
        """Forget the counts not yet written: for test suites that roll each test back."""
        with self._lock:
            self._pending = {}

    def pending(self) -> int:
        """How many counted events wait to be written."""
        with self._lock:
            return sum(c.times for rows in self._pending.values() for c in rows.values())

    def flush(self) -> int:
        """Write the waiting counts now, in this thread; return how many were written.

        A database error drops the counts it could not write (they are statistics), and is
        logged.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        return sum(self._write(table, rows) for table, rows in pending.items())

    def _write(self, table: Rows, rows: Mapping[tuple[int, int], Count]) -> int:
        try:
            self.write(*table, rows)
        except db.Error:  # any database failure: psycopg2's lost connection is no DatabaseError
            logger.warning("could not write the deferred counts of %d rows", len(rows))
            return 0
        return sum(count.times for count in rows.values())

    def _flush_in_background(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.flush()
        except Exception:  # the timer thread has no caller to tell
            logger.exception("could not write deferred counts")
        finally:
            # This thread's connections: it may never run again.
            connections.close_all()


def _shared_in_memory(using: str) -> bool:
    connection = connections[using]
    return (
        connection.vendor == "sqlite"
        and cast("SQLiteDatabaseWrapper", connection).is_in_memory_db()
    )
