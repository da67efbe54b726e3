"""The loop of a long-running worker of the retry queue: the inbox's "database" runner and the
outbox's relay (``manage.py idempotency_inbox --forever``, ``idempotency_outbox --forever``).

It runs a step (take due jobs and run them), reports it, and waits, until its stop event is set;
the job being run then is finished first. A step that fails (a lost connection, say) is logged
and the loop carries on: the jobs stay due for the next one.

Between steps it waits for the interval, or on PostgreSQL for a notification on the queue's
channel first. The interval still matters there: it is when retries that came due are taken.
A pooler in transaction mode (PgBouncer) does not carry notifications: a worker that finds its
listening connection goes through one says so and waits for the interval alone.
"""

from __future__ import annotations

import contextlib
import select
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django.db import close_old_connections, connections

from django_idempotency.core.databases import behind_pooler

if TYPE_CHECKING:
    import logging
    import threading
    from collections.abc import Callable

_R = TypeVar("_R")

# The longest a wait runs before it looks at the stop event again.
_STOP_CHECK = 0.5


@dataclass(frozen=True)
class Worker(Generic[_R]):
    """What a queue hands the loop: its ``step``, and how to tell and wake it."""

    name: str  # as its log lines call it: "the inbox worker"
    logger: logging.Logger
    #: Takes due jobs and runs them, asking the callable it is given before each job whether to
    #: stop; returns what it did.
    step: Callable[[Callable[[], bool]], _R]
    #: Whether, after a step that did this, more jobs are due at once: then no wait.
    more: Callable[[_R], bool] = lambda result: False
    #: On PostgreSQL, the database on which a wait listens for ``channel``: a notification
    #: there ends it. None: it waits for the interval alone.
    listen_using: str | None = None
    channel: str = ""
    jobs: str = "jobs"  # what it takes, as its log lines say: "events"


def run_worker(
    worker: Worker[_R],
    *,
    stop: threading.Event,
    interval: float,
    report: Callable[[_R], None] | None = None,
) -> None:
    """Run ``worker``'s steps in this thread until ``stop`` is set, waiting ``interval`` seconds
    between them unless more jobs are due at once; ``report`` is given what each step did."""
    waiter = _Listener(worker)
    try:
        while not stop.is_set():
            busy = False
            try:
                result = worker.step(stop.is_set)
                if report is not None:
                    report(result)
                busy = worker.more(result)
            except Exception:  # a lost connection, say: the jobs stay due for the next step
                worker.logger.exception("%s's run failed; it carries on", worker.name)
            close_old_connections()
            if not busy:
                waiter.wait(interval, stop)
    finally:
        waiter.close()


class _Listener:
    """Wait for the interval, or on PostgreSQL for a notification on the worker's channel."""

    def __init__(self, worker: Worker[Any]) -> None:
        self.worker = worker
        using = worker.listen_using
        self.listens = using is not None and connections[using].vendor == "postgresql"
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
                self.worker.logger.warning(
                    "%s stopped listening; reconnecting", self.worker.name, exc_info=True
                )
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
                # The rest arrived together: one step answers them all.
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
        worker = self.worker
        if self.connection is None and worker.listen_using is not None:
            wrapper = connections.create_connection(worker.listen_using)
            wrapper.ensure_connection()
            wrapper.set_autocommit(True)
            if behind_pooler(wrapper):
                wrapper.close()
                self.listens = False
                worker.logger.warning(
                    "%s's connection to the %r database goes through a pooler, which does not "
                    "carry notifications: the worker looks for new %s every --interval; give it "
                    "--listen-database with a direct connection to be woken at once",
                    worker.name,
                    worker.listen_using,
                    worker.jobs,
                )
                return None
            with wrapper.cursor() as cursor:
                cursor.execute(f"LISTEN {worker.channel}")
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
