"""Lease renewal: a lease-mode request that is alive keeps its lease, however long it runs.

A lease exists to hand a key over when its request died. A request that is only slow (a payment
provider taking longer than the lease) must keep its key, or a retry would take the key over and
run the effect a second time. So while the view runs, one thread per process extends the lease
of every running request, each a third of its lease before it would run out. A request whose
process is frozen or cut off from the database for longer than its lease does lose its key:
then the fence on its completion (the lease version) rolls its writes back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django import db
from django.db import connections
from django.utils import timezone

from django_idempotency import signals

if TYPE_CHECKING:
    from collections.abc import Iterator
    from datetime import timedelta

    from django_idempotency.core.rows import Claim
    from django_idempotency.core.store import KeyStore

logger = logging.getLogger("django_idempotency")


@dataclass(eq=False)
class _Lease:
    store: KeyStore
    claim: Claim
    key: str
    timeout: timedelta
    started: float = field(default_factory=time.monotonic)
    due: float = 0.0  # when to renew next, on the monotonic clock
    overdue_reported: bool = False

    def __post_init__(self) -> None:
        self.due = self.started + self.timeout.total_seconds() / 3


class LeaseKeeper:
    """Renews the leases of the requests running in this process, from one daemon thread."""

    def __init__(self) -> None:
        self._reset()
        # A forked worker (gunicorn, Celery prefork) has no thread and maybe a held lock.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._leases: set[_Lease] = set()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def keep(self, store: KeyStore, claim: Claim, key: str, timeout: timedelta) -> Iterator[None]:
        """Keep ``claim``'s lease alive while the block runs."""
        lease = _Lease(store, claim, key, timeout)
        with self._changed:
            self._leases.add(lease)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="idempotency-leases", daemon=True
                )
                self._thread.start()
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._leases.discard(lease)

    def _run(self) -> None:
        while True:
            with self._changed:
                due = self._due_leases()
            for lease in due:
                self._renew(lease)
            if due:
                # Each renewal round opens its own connections: hold none between rounds.
                connections.close_all()

    def _due_leases(self) -> list[_Lease]:
        """Wait (holding the condition) until some lease is due; return the due ones."""
        while True:
            now = time.monotonic()
            due = [lease for lease in self._leases if lease.due <= now]
            if due:
                return due
            wake = min((lease.due for lease in self._leases), default=None)
            self._changed.wait(None if wake is None else wake - now)

    def _renew(self, lease: _Lease) -> None:
        timeout = lease.timeout.total_seconds()
        lease.due = time.monotonic() + timeout / 3
        store = type(lease.store)(
            lease.store.model, lease.store.using
        )  # this thread's own connection
        try:
            renewed = store.renew(lease.claim, timezone.now() + lease.timeout)
        except db.Error:  # any database failure: psycopg2's lost connection is no DatabaseError
            logger.warning("could not renew the lease on idempotency key %s", lease.key)
            return
        if not renewed:
            return  # completed meanwhile, or taken over: the completion's fence decides
        signals.send_robustly(signals.lease_renewed, lease.store.model, key=lease.key)
        running = time.monotonic() - lease.started
        if running > timeout and not lease.overdue_reported:
            lease.overdue_reported = True
            logger.warning(
                "a lease-mode request with idempotency key %s has run for %.0f s, longer than "
                "its %.0f s lease; its lease is renewed while it runs, but a client may time "
                "out first: give the effect's own calls timeouts shorter than the lease",
                lease.key,
                running,
                timeout,
            )


leases = LeaseKeeper()
