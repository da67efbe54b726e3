"""The "database" runner's worker: take due inbox events from the table and process them.

Between batches the worker waits: on PostgreSQL for a notification on ``CHANNEL`` (sent as an
event's recording commits) or the end of the interval, elsewhere for the interval alone. The
interval still matters on PostgreSQL: it is when retries that came due are taken. A pooler in
transaction mode (PgBouncer) does not carry notifications: a worker that finds its listening
connection goes through one says so and waits for the interval alone.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from typing import TYPE_CHECKING, Any

from django.db import close_old_connections, connections, router

from django_idempotency.core.databases import behind_pooler
from django_idempotency.inbox.processing import CHANNEL, process_due
from django_idempotency.models import InboxEvent

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

logger = logging.getLogger("django_idempotency.inbox")

# The longest a wait runs before it looks at the stop event again.
_STOP_CHECK = 0.5


def run_worker(
    *,
    stop: threading.Event,
    batch_size: int = 50,
    interval: float = 1.0,
    after_batch: Callable[[int], None] | None = None,
    listen_using: str | None = None,
) -> None:
    """Process due inbox events in this thread until ``stop`` is set; the event being
    processed when it is set is finished first.

    ``after_batch`` is called with how many events each batch took, zero included. On
    PostgreSQL the worker listens on the ``listen_using`` database (default: the inbox's own),
    a direct connection when the inbox's goes through a pooler.
    """
    waiter = _Listener(listen_using or router.db_for_write(InboxEvent))
    try:
        while not stop.is_set():
            taken = 0
            try:
                taken = process_due(limit=batch_size, stop=stop.is_set)
                if after_batch is not None:
                    after_batch(taken)
            except Exception:  # a lost connection, say: the events stay due for the next run
                logger.exception("the inbox worker's run failed; it carries on")
            close_old_connections()
            if taken < batch_size:
                waiter.wait(interval, stop)
    finally:
        waiter.close()


class _Listener:
    """Wait for the interval, or on PostgreSQL for a notification on ``CHANNEL`` first."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.listens = connections[using].vendor == "postgresql"
        self.connection: Any = None  # its own connection, which does nothing but listen

    def wait(self, interval: float, stop: threading.Event) -> None:
        deadline = time.monotonic() + interval
        while not stop.is_set() and (remaining := deadline - time.monotonic()) > 0:
            timeout = min(remaining, _STOP_CHECK)
            if not self.listens:
                stop.wait(timeout)
                continue
            try:
                if self._notified(timeout):
                    return
            except Exception:  # the listening connection was lost: listen again next time
                logger.warning("the inbox worker stopped listening; reconnecting", exc_info=True)
                self.close()
                stop.wait(timeout)

    def _notified(self, timeout: float) -> bool:
        raw = self._listening()
        if raw is None:  # behind a pooler: the wait goes on without listening
            return False
        if callable(raw.notifies):  # psycopg 3
            with contextlib.closing(raw.notifies(timeout=timeout, stop_after=1)) as notifies:
                notified = next(notifies, None) is not None
            if notified:
                # The rest arrived together: one batch answers them all.
                with contextlib.closing(raw.notifies(timeout=0)) as backlog:
                    for _ in backlog:
                        pass
            return notified
        # psycopg2
        if not raw.notifies:
            select.select([raw], [], [], timeout)
            raw.poll()
        notified = bool(raw.notifies)
        raw.notifies.clear()
        return notified

    def _listening(self) -> Any:
        if self.connection is None:
            wrapper = connections.create_connection(self.using)
            wrapper.ensure_connection()
            wrapper.set_autocommit(True)
            if behind_pooler(wrapper):
                wrapper.close()
                self.listens = False
                logger.warning(
                    "the inbox worker's connection to the %r database goes through a pooler, "
                    "which does not carry notifications: the worker looks for new events "
                    "every --interval; give it --listen-database with a direct connection to be "
                    "woken at once",
                    self.using,
                )
                return None
            with wrapper.cursor() as cursor:
                cursor.execute(f"LISTEN {CHANNEL}")
            self.connection = wrapper
        return self.connection.connection

    def close(self) -> None:
        if self.connection is not None:
            # A pooled connection goes back to the pool: it must not keep collecting
            # notifications that nobody reads.
            with contextlib.suppress(Exception), self.connection.cursor() as cursor:
                cursor.execute("UNLISTEN *")
            with contextlib.suppress(Exception):
                self.connection.close()
            self.connection = None
