"""Counts kept in memory and written to their rows about a second later, in one transaction.

A replay answers from one read of its key's row, and a duplicate webhook delivery from the
insert that found its event recorded: neither writes, so neither waits for a row lock or for the
disk. The admin still shows how often a key was replayed, and an event delivered, and when last:
each process counts them here, and a writer thread writes them about a second after the first
one since the last write. A process that dies loses the counts of its last second, never a
stored response or an event.

The writer keeps its database connection from one write to the next while counts keep coming,
and closes it once a delay passes without any. Under an ASGI server with ``CONN_MAX_AGE = 0``
each request's connection is its own and closed with it, so a steady stream of replays costs
the process one more connection in all, not one each second; no request ever waits for it.

A count is kept by row id and row version (a key's lease version): a key taken over meanwhile,
by a new request after it expired, starts its count afresh.

On an in-memory SQLite database (a test database) a count is written at once, in the thread that
counted it. Threads share such a database through SQLite's shared cache, which refuses a second
writer at once instead of making it wait: a timer thread writing there could make a test's own
statements fail.
"""

from __future__ import annotations

import logging
import os
import threading
import time
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
        self._reset()
        # A forked worker (gunicorn, Celery prefork) has no writer thread and maybe a held lock.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._pending: dict[Rows, dict[tuple[int, int], Count]] = {}
        self._changed = threading.Condition()
        self._due: float | None = None  # when the pending counts are to be written (monotonic)
        self._writer: threading.Thread | None = None
        self._idle = False  # the writer is to close its connection now
        self._connected = False  # the writer may hold a connection

    def add(self, model: type[Model], using: str, row_id: int, version: int, at: datetime) -> int:
        """Count one more of ``model``'s row ``row_id`` (at ``version``) at ``at``, to be
        written within ``delay``.

        Return how many of that row this process counted since its last write.
        """
        if _shared_in_memory(using):
            self._write((model, using), {(row_id, version): Count(1, at)})
            return 1
        with self._changed:
            rows = self._pending.setdefault((model, using), {})
            count = rows.get((row_id, version))
            if count is None:
                count = rows[(row_id, version)] = Count(0, at)
            count.times += 1
            count.last_at = max(count.last_at, at)
            if self._due is None:
                self._due = time.monotonic() + self.delay
                self._idle = False
                self._changed.notify_all()
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(
                    target=self._run, name="idempotency-counts", daemon=True
                )
                self._writer.start()
            return count.times

    def discard(self) -> None:
        """Forget the counts not yet written, and have the writer close its connection: for
        test suites that roll each test back (and then drop the test database)."""
        with self._changed:
            self._pending = {}
            self._due = None
            self._idle = True
            self._changed.notify_all()
            writer = self._writer
            # Until it has closed the connection (a few milliseconds).
            self._changed.wait_for(
                lambda: not self._connected or writer is None or not writer.is_alive(), timeout=5
            )

    def pending(self) -> int:
        """How many counted events wait to be written."""
        with self._changed:
            return sum(c.times for rows in self._pending.values() for c in rows.values())

    def flush(self) -> int:
        """Write the waiting counts now, in this thread; return how many were written.

        A database error drops the counts it could not write (they are statistics), and is
        logged.
        """
        return self._flush()[0]

    def _flush(self) -> tuple[int, bool]:
        """Write the waiting counts; return how many were written, and whether all were."""
        with self._changed:
            pending, self._pending = self._pending, {}
            self._due = None
        written = [self._write(table, rows) for table, rows in pending.items()]
        return sum(written), all(written)

    def _write(self, table: Rows, rows: Mapping[tuple[int, int], Count]) -> int:
        try:
            self.write(*table, rows)
        except db.Error:  # any database failure: psycopg2's lost connection is no DatabaseError
            logger.warning("could not write the deferred counts of %d rows", len(rows))
            return 0
        return sum(count.times for count in rows.values())

    def _run(self) -> None:
        """The writer thread: write the counts when due, for as long as the process lives."""
        while True:
            if not self._wait_until_due(idle=self.delay):
                # Nothing counted for a while: hold no connection while there is nothing to do.
                self._disconnect()
                self._wait_until_due(idle=None)
            with self._changed:
                self._connected = True
            try:
                written_all = self._flush()[1]
            except Exception:  # the writer has no caller to tell
                logger.exception("could not write deferred counts")
                written_all = False
            if not written_all:
                # The connection may be what failed: the next write opens a new one.
                self._disconnect()

    def _disconnect(self) -> None:
        connections.close_all()
        with self._changed:
            self._connected = False
            self._changed.notify_all()

    def _wait_until_due(self, idle: float | None) -> bool:
        """Wait until counts are due to be written; ``False`` if none came within ``idle``
        seconds (``None``: wait as long as it takes)."""
        idle_until = None if idle is None else time.monotonic() + idle
        with self._changed:
            while True:
                now = time.monotonic()
                if self._due is not None and self._due <= now:
                    return True
                if (
                    self._due is None
                    and idle_until is not None
                    and (self._idle or idle_until <= now)
                ):
                    self._idle = False
                    return False
                wake = self._due if self._due is not None else idle_until
                self._changed.wait(None if wake is None else wake - now)


def _shared_in_memory(using: str) -> bool:
    connection = connections[using]
    return (
        connection.vendor == "sqlite"
        and cast("SQLiteDatabaseWrapper", connection).is_in_memory_db()
    )
