"""The engine: claim the key, run the operation, store its result, or replay a stored one.

An *operation* is anything made idempotent by key: a view's request, a Celery task's delivery.
``Engine.run`` walks one through the key table, knowing nothing of HTTP: a view's request is
such an operation in ``core/keyed_request.py``, whose ``handle()`` the DRF mixin, the view
decorator and Ninja are thin adapters over; the task decorator hands it a delivery.

A key that a completed run holds is replayed from one read of its row, which writes nothing and
locks no row: before any transaction, or (atomic mode on PostgreSQL) the read that holds the key.
Otherwise the key is claimed.

Atomic mode: the key is held inside the same ``transaction.atomic`` as the view's own writes,
and its completed row is written before the commit, so a fresh request costs one commit and a
crash rolls back the key with the effect. A concurrent duplicate waits, bounded, until the first
commits, then replays. How the key is held is the store's: on PostgreSQL a transaction-scoped
advisory lock, and the row is written once, completed; elsewhere a row inserted first, locked by
the unique index until the commit.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, TypeVar

from django.core.exceptions import ImproperlyConfigured
from django.db import router, transaction
from django.utils import timezone

from django_idempotency.core.leases import LeaseKeeper
from django_idempotency.core.leases import leases as default_leases
from django_idempotency.core.operation import Answer, Operation
from django_idempotency.core.outcomes import Outcome
from django_idempotency.core.rows import POLL_SECONDS, Claim, Conflict, KeyBusy, StoredResponse
from django_idempotency.core.store import KeyStore, key_store
from django_idempotency.core.tables import key_model
from django_idempotency.core.unavailable import DATABASE_UNAVAILABLE

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from django.db.models import Model

R = TypeVar("R")
T = TypeVar("T")

logger = logging.getLogger("django_idempotency")


def _release(store: KeyStore, claim: Claim) -> bool:
    """Mark a lease-mode key failed so that a retry runs again; never mask the real error.

    ``False`` if another run took the key over meanwhile. A database that is unavailable
    leaves the key to its lease; any other database error is a fault, and surfaces.
    """
    try:
        return store.fail(claim)
    except DATABASE_UNAVAILABLE:
        logger.warning("could not release an idempotency key; its lease will run out")
        return True


def _pause_until(deadline: float) -> None:
    """Wait a little before looking at a key again; ``KeyBusy`` once ``deadline`` passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise KeyBusy
    time.sleep(min(POLL_SECONDS, remaining))


def _settled(operation: Operation[R], found: StoredResponse | Conflict) -> Answer[R] | None:
    """The answer when another run holds the key: its stored result replayed, or a mismatch
    if that run was a different one; ``None`` while it is still running."""
    if isinstance(found, StoredResponse):
        return Answer(Outcome.REPLAYED, operation.decode(found), found.replay_count + 1)
    if found.fingerprint_matches:
        return None
    return Answer(Outcome.MISMATCH)


class Engine:
    """Claim → execute → store, or replay.

    ``clock``, ``leases`` and ``store`` are injectable for tests. Without a store, each
    operation uses ``model``'s table on the database that the project's routers choose for
    writing it; without a model, the key table that the app config handed to the core.
    """

    def __init__(
        self,
        clock: Callable[[], datetime] = timezone.now,
        leases: LeaseKeeper = default_leases,
        store: KeyStore | None = None,
        model: type[Model] | None = None,
    ) -> None:
        self.clock = clock
        self.leases = leases
        self.store = store
        self.model = model

    def run(self, operation: Operation[R]) -> Answer[R]:
        """Run ``operation``'s body at most once for its key, or answer as the run that did.

        The body's exceptions, and a database's, propagate: the body's writes are rolled back,
        and in lease mode the key is released first.
        """
        try:
            if operation.cache is not None:
                cached = operation.cache.get(
                    scope=operation.scope,
                    key=operation.key,
                    fingerprint=operation.fingerprint,
                    now=self.clock(),
                )
                if cached is not None:
                    return Answer(Outcome.REPLAYED, operation.decode(cached))
            store = self.store or self._store()
            if operation.mode == "lease":
                return self._execute_lease(operation, store)
            return self._execute(operation, store)
        except KeyBusy:
            return Answer(Outcome.IN_PROGRESS)

    def _store(self) -> KeyStore:
        model = self.model or key_model()
        return key_store(model, router.db_for_write(model))

    def _replayed(self, operation: Operation[R], store: KeyStore) -> Answer[R] | None:
        """The answer of a run that completed with the key, or the refusal of a different
        request, from one read before any transaction of the engine's: a replay writes nothing
        and waits for no lock. ``None``: the key is to be claimed."""
        found = store.lookup(operation.new_key(self.clock()))
        return None if found is None else _settled(operation, self._cached(operation, store, found))

    def _acquire(
        self, operation: Operation[R], store: KeyStore, *, reserve: bool = False
    ) -> Claim | StoredResponse | Conflict:
        """Ask the store for the key once; a result it replays goes to the cache too.

        ``reserve``: for a run whose transaction writes its row (atomic mode).
        """
        new = operation.new_key(self.clock())
        found = store.reserve(new) if reserve else store.acquire(new)
        return self._cached(operation, store, found)

    @staticmethod
    def _cached(operation: Operation[R], store: KeyStore, found: T) -> T:
        """``found``; if it is a stored result, put in the replay cache too."""
        if isinstance(found, StoredResponse) and operation.cache is not None:
            # Filled by the first replay, not by the run that stored the result: most keys
            # are never replayed, and a fresh request should not pay for a cache write.
            operation.cache.put_after_commit(
                scope=operation.scope,
                key=operation.key,
                fingerprint=operation.fingerprint,
                stored=found,
                using=store.using,
            )
        return found

    def _complete(self, operation: Operation[R], store: KeyStore, claim: Claim, result: R) -> bool:
        """Store the result on its claimed row. ``False`` if another run took the key over
        meanwhile."""
        record = operation.encode(result)
        return store.complete(
            claim, status=record.status, headers=record.headers, body=record.body, now=self.clock()
        )

    def _execute(self, operation: Operation[R], store: KeyStore) -> Answer[R]:
        """Atomic mode: claim, run and complete in one transaction with the body's writes."""
        connection = transaction.get_connection(store.using)
        # Under ATOMIC_REQUESTS, DRF marks the transaction for rollback when a view raises an
        # API error. A savepoint then undoes just the view's writes, and its answer is still
        # stored with the key; without ATOMIC_REQUESTS it would cost round trips.
        savepoint = bool(connection.settings_dict.get("ATOMIC_REQUESTS"))
        # A store that reads the key's row as it holds the key answers a replay from that read:
        # a fresh request sends one statement fewer, and a replay's read is a transaction's.
        if not store.reserve_reads and (replayed := self._replayed(operation, store)) is not None:
            return replayed
        with transaction.atomic(using=store.using):
            claim = self._acquire(operation, store, reserve=True)
            if not isinstance(claim, Claim):
                # The store waited on the other run as long as the operation allows.
                if (settled := _settled(operation, claim)) is None:
                    raise KeyBusy
                return settled
            with transaction.atomic(using=store.using, savepoint=savepoint):
                result = operation.run(claim.attempts)
            rolled_back = transaction.get_rollback(store.using)
            kept = not rolled_back and operation.keeps(result)
            # Never commit the body's writes without the key's row: a run that stored the key
            # first (one the store's hold on the key did not see) keeps its own.
            stored = kept and self._complete(operation, store, claim, result)
            if not stored:
                # Keep nothing, so that a retry runs on a clean slate.
                transaction.set_rollback(True, using=store.using)
        if stored:
            return Answer(Outcome.STORED, result, claim.attempts)
        if not kept:
            return Answer(Outcome.NOT_STORED, result, claim.attempts)
        return self._holders_answer(operation, store)

    def _execute_lease(self, operation: Operation[R], store: KeyStore) -> Answer[R]:
        """Lease mode: commit the claim first, run the body under the lease, then store.

        For effects that leave the database (a card charge): a duplicate sees the committed
        claim and waits for the result, and a run that dies leaves a lease that runs out, after
        which the next run with the key takes it over. The body's own writes commit in one
        transaction with the completion, which the lease version fences: a run whose key was
        taken over keeps none of them.
        """
        if transaction.get_connection(store.using).in_atomic_block:
            raise ImproperlyConfigured(operation.lease_in_transaction)
        if (replayed := self._replayed(operation, store)) is not None:
            return replayed
        claim = self._wait_for_claim(operation, store)
        if not isinstance(claim, Claim):
            return claim
        with self.leases.keep(store, claim, operation.key, operation.lease_timeout):
            try:
                ran = self._run_fenced(operation, store, claim)
            except Exception:
                if _release(store, claim):
                    raise
                return self._superseded(operation, store)
        if ran is None:
            return self._superseded(operation, store)  # the key is no longer this run's
        result, kept = ran
        if not kept and not _release(store, claim):
            return self._superseded(operation, store)
        outcome = Outcome.STORED if kept else Outcome.NOT_STORED
        return Answer(outcome, result, claim.attempts)

    def _wait_for_claim(self, operation: Operation[R], store: KeyStore) -> Claim | Answer[R]:
        """Claim the key; while a live run holds it, look again until the wait runs out."""
        deadline = time.monotonic() + operation.wait_timeout
        while True:
            with transaction.atomic(using=store.using):
                found = self._acquire(operation, store)
            if isinstance(found, Claim):
                return found
            if (settled := _settled(operation, found)) is not None:
                return settled
            # A lease that runs out meanwhile is taken over by the claim itself.
            _pause_until(deadline)

    def _run_fenced(
        self, operation: Operation[R], store: KeyStore, claim: Claim
    ) -> tuple[R, bool] | None:
        """Run the body (or the recovery) and store its result in one transaction.

        Return the result and whether it was kept; ``None`` if the lease was taken over
        meanwhile, so the body's writes were rolled back. A result that is not to be stored is
        returned unkept, its writes rolled back too.
        """
        with transaction.atomic(using=store.using):
            result = None
            if claim.attempts > 1:
                # An earlier run with this key did not finish: its effect may have happened.
                result = operation.recover(claim.attempts)
            if result is None:
                result = operation.run(claim.attempts)
            if not operation.keeps(result):
                transaction.set_rollback(True, using=store.using)
                return result, False
            if not self._complete(operation, store, claim, result):
                transaction.set_rollback(True, using=store.using)
                return None
        return result, True

    def _superseded(self, operation: Operation[R], store: KeyStore) -> Answer[R]:
        """Answer a run whose key was taken over while it ran with the new owner's answer."""
        logger.error(
            "the lease on idempotency key %s (%s %s) was taken over while it ran: its writes "
            "were rolled back, and it answers with the new owner's result",
            operation.key,
            operation.method,
            operation.route,
        )
        return self._holders_answer(operation, store)

    def _holders_answer(self, operation: Operation[R], store: KeyStore) -> Answer[R]:
        """Answer a run whose writes were rolled back, as the run that holds its key answers."""
        deadline = time.monotonic() + operation.wait_timeout
        while True:
            found = store.replay(operation.new_key(self.clock()))
            if (settled := _settled(operation, found)) is not None:
                return settled
            _pause_until(deadline)


default_engine = Engine()
