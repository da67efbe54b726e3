"""What is done to the ``IdempotencyKey`` table: claim, replay, complete, renew, release, purge.

A completed response is replayed from one read of the key's row, which locks no row and writes
nothing; a different request with the key is refused. Otherwise the key is claimed, and the
unique index on (scope, key) decides every race. On SQLite (and in lease mode on PostgreSQL) the
read comes first, outside any transaction of the engine's, and a claim is one ``INSERT … ON
CONFLICT DO NOTHING RETURNING``; a row that holds the key is then read: replayed if completed,
taken over by ``INSERT … ON CONFLICT DO UPDATE … WHERE <free> RETURNING`` if expired, failed or
lease-lost. A duplicate blocks on the first request's uncommitted row: on PostgreSQL for at most
a ``lock_timeout`` that the claiming statement puts back itself, so the view's statements never
run under it; SQLite serializes writers instead (its busy timeout, then a retryable 503).
MariaDB claims with an insert that locks the row holding the key (``MariaDBKeyStore``). In atomic
mode on PostgreSQL nothing is written before the view, and the row is read once, inside the
transaction, as duplicates take turns on an advisory lock on the key (``PostgreSQLKeyStore``).
The statements themselves are in ``statements.py``; a replay's count waits in memory
(``counting.py``).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from django.db import OperationalError, connections, transaction

from django_idempotency import signals
from django_idempotency.core import statements
from django_idempotency.core.counting import Count, DeferredCounts
from django_idempotency.core.databases import (
    DEADLOCK,
    LOCK_WAIT_TIMEOUT,
    again_after_deadlocks,
    is_lock_timeout,
    mariadb_error,
    placeholders,
)
from django_idempotency.core.rows import (
    FIRST_POLL_SECONDS,
    POLL_SECONDS,
    Claim,
    Conflict,
    KeyBusy,
    NewKey,
    Reservation,
    StoredResponse,
    claimed,
    is_free,
    lease_ran_out,
    stored_response,
)
from django_idempotency.core.statements import Holder

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from datetime import datetime

    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model

    from django_idempotency.core.statements import (
        MariaDBStatements,
        PostgreSQLStatements,
        Statements,
    )


def key_store(model: type[Model], using: str) -> KeyStore:
    """The store of ``model``'s keys on the database ``using``; cheap to make for each request.

    MariaDB claims differently; a caller need not know which database it talks to.
    """
    vendor = connections[using].vendor
    if vendor == "mysql":
        return MariaDBKeyStore(model, using)
    if vendor == "postgresql":
        return PostgreSQLKeyStore(model, using)
    return KeyStore(model, using)


# Built once per table and database vendor, not per request.
_STATEMENTS: dict[tuple[type[Model], str], Statements] = {}
_POSTGRESQL_STATEMENTS: dict[type[Model], PostgreSQLStatements] = {}
_MARIADB_STATEMENTS: dict[type[Model], MariaDBStatements] = {}


class KeyStore:
    """The key table's queries on one database alias (see ``key_store()``)."""

    # Whether reserve() reads the key's row and answers a replay as well as a claim would: then
    # an atomic-mode run does not read the row before its transaction.
    reserve_reads = False

    def __init__(self, model: type[Model], using: str) -> None:
        self.model = model
        self.using = using
        self.connection: BaseDatabaseWrapper = connections[using]
        built = (model, self.connection.vendor)
        if built not in _STATEMENTS:
            _STATEMENTS[built] = statements.build(model, self.connection)
        self.sql = _STATEMENTS[built]

    def _prep(self, name: str, value: Any) -> Any:
        field = self.model._meta.get_field(name)
        return field.get_db_prep_save(value, self.connection)  # type: ignore[union-attr] # a concrete field

    def lookup(self, new: NewKey) -> StoredResponse | Conflict | None:
        """The completed response that answers ``new``, or the refusal of another request with
        its key, from one read of the key's row without a lock; ``None`` if the key is to be
        claimed: no row holds it, the row is free to take over, or ``new``'s run is still on."""
        row = self._read(new)
        if row is None or is_free(row, new):
            return None
        if row.state != "succeeded" and row.fingerprint == new.fingerprint:
            return None  # the claim waits for that run, or takes its row over
        return self._replay_or_refuse(row, new)

    def _read(self, new: NewKey) -> Holder | None:
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.holder, [new.scope, new.key])
            fetched = cursor.fetchone()
        return None if fetched is None else Holder(*fetched)

    def acquire(self, new: NewKey) -> Claim | StoredResponse | Conflict:
        """Claim the key; or replay the completed row that holds it; or say why neither can be.

        Must run inside ``transaction.atomic``. Raises ``KeyBusy`` when the wait on a concurrent
        request's uncommitted row is exceeded.
        """
        row = self._fetch(self.sql.insert, self._claim_params(new, takeover=False))
        if row is not None:
            return claimed(row, new)
        # A row holds the key: committed before this statement, or while it waited.
        found = self._holder(new, take_over=True)
        assert found is not None  # noqa: S101 - a takeover that loses finds the winner's row
        return found

    def reserve(self, new: NewKey) -> Claim | StoredResponse | Conflict:
        """Hold the key for an atomic-mode run, whose transaction then writes the completed row.

        As ``acquire()``, which it is but on PostgreSQL; must run inside ``transaction.atomic``.
        A ``complete()`` that answers ``False`` then means another run stored the key first.
        """
        return self.acquire(new)

    def claim(self, new: NewKey) -> Claim | None:
        """Insert the key row, or take over one that expired, failed or lost its lease.

        ``None`` if a live row holds the key. Must run inside ``transaction.atomic``. Raises
        ``KeyBusy`` when the wait on a duplicate's uncommitted row is exceeded.
        """
        row = self._fetch(self.sql.claim, self._claim_params(new, takeover=True))
        return None if row is None else claimed(row, new)

    def replay(self, new: NewKey) -> StoredResponse | Conflict:
        """The completed response that holds the key, or why it cannot be replayed."""
        found = self._holder(new, take_over=False)
        if isinstance(found, StoredResponse | Conflict):
            return found
        return Conflict(fingerprint_matches=True)  # free to be taken over: not replayable

    def _holder(self, new: NewKey, *, take_over: bool) -> Claim | StoredResponse | Conflict | None:
        """What becomes of a request whose key a row holds: it replays the row, is refused, or
        (if ``take_over``) takes over a row that expired, failed or lost its lease.

        ``None``: the row could be taken over, but not by this call.
        """
        for _ in range(3):  # a row taken over or purged meanwhile: look again
            row = self._read(new)
            if row is None or is_free(row, new):
                if not take_over:
                    return None
                if (claim := self.claim(new)) is not None:
                    if row is not None and lease_ran_out(row, new):
                        self._report_takeover(new)
                    return claim
                continue  # another request took the row over first: it holds the key now
            return self._replay_or_refuse(row, new)
        raise KeyBusy  # the row changed hands three times while this request looked

    def _report_takeover(self, new: NewKey) -> None:
        """Signal that ``new`` took over a lease that ran out, once its claim commits."""
        sent = {"key": new.key, "scope": new.scope, "route": new.route}
        transaction.on_commit(
            lambda: signals.send_robustly(signals.lease_taken_over, self.model, **sent),
            using=self.using,
        )

    def _replay_or_refuse(self, row: Holder, new: NewKey) -> StoredResponse | Conflict:
        if row.fingerprint != new.fingerprint:
            return Conflict(fingerprint_matches=False)
        if row.state != "succeeded":
            return Conflict(fingerprint_matches=True)  # still running
        stored = stored_response(row)
        # Counted as written, with this process's replays that are not yet.
        unwritten = replay_counts.add(self.model, self.using, row.id, row.lease_version, new.now)
        return replace(stored, replay_count=stored.replay_count + unwritten)

    def _claim_params(self, new: NewKey, *, takeover: bool) -> list[Any]:
        inserted = self._inserted(new)
        params = [inserted[name] for name in statements.CLAIMED]
        if takeover:
            prepared_now = self._prep("expires_at", new.now)
            params += [prepared_now, prepared_now]
        if self.connection.vendor == "postgresql":
            # PostgreSQL reads a lock_timeout of 0 as "wait forever": the shortest wait is 1 ms.
            params.insert(0, f"{max(1, round(new.wait_timeout * 1000))}ms")
        return params

    def _inserted(self, new: NewKey) -> dict[str, Any]:
        """The new row's values, by column, in the order of ``statements.INSERTED``."""
        values = {
            "scope": new.scope, "key": new.key, "method": new.method, "route": new.route,
            "fingerprint": new.fingerprint, "state": "in_progress", "lease_version": 1,
            "locked_until": self._prep("locked_until", new.locked_until), "attempts": 1,
            "created_at": self._prep("created_at", new.now),
            "expires_at": self._prep("expires_at", new.expires_at), "replay_count": 0,
        }  # fmt: skip
        return {name: values[name] for name in statements.INSERTED}

    def _fetch(self, sql: str, params: list[Any]) -> tuple[Any, ...] | None:
        """Run a claiming statement; ``KeyBusy`` if its wait on a duplicate timed out."""
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(sql, params)
            except OperationalError as exc:
                if is_lock_timeout(exc):
                    raise KeyBusy from exc
                raise
            row = cast("tuple[Any, ...] | None", cursor.fetchone())
        # PostgreSQL's claim answers one row, of NULLs when it claimed nothing (statements.py).
        return None if row is None or row[0] is None else row

    def write_replay_counts(self, counts: Mapping[tuple[int, int], Count]) -> None:
        """Add replays counted in memory to their rows, in one transaction of their own."""
        params = [
            [count.times, *[self._prep("last_replayed_at", count.last_at)] * 2, id_, version]
            for (id_, version), count in sorted(counts.items())  # in id order: no deadlocks
        ]
        with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
            if self.connection.vendor == "postgresql":
                # Statistics: the commit need not wait for the disk.
                cursor.execute("SET LOCAL synchronous_commit TO OFF")
            cursor.executemany(self.sql.count_replays, params)

    def complete(
        self,
        claim: Claim,
        *,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        now: datetime,
    ) -> bool:
        """Store the response on the claimed row. ``False`` if another request took it over."""
        response = self._response(status, headers, body, now)
        params = ["succeeded", *response, claim.id, claim.lease_version]
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.complete, params)
            return bool(cursor.rowcount == 1)

    def _response(
        self, status: int, headers: list[tuple[str, str]], body: bytes, now: datetime
    ) -> list[Any]:
        """A completion's values, in the order of ``statements.COMPLETED``."""
        return [
            status,
            self._prep("response_headers", headers),
            self._prep("response_body", body),
            self._prep("completed_at", now),
        ]

    def fail(self, claim: Claim) -> bool:
        """Mark the claimed row failed, so the next request takes it over. Fenced like complete."""
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.fail, [claim.id, claim.lease_version])
            return bool(cursor.rowcount == 1)

    def renew(self, claim: Claim, locked_until: datetime) -> bool:
        """Extend a running request's lease. ``False`` if the row is no longer its own."""
        until = self._prep("locked_until", locked_until)
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.renew, [until, claim.id, claim.lease_version])
            return bool(cursor.rowcount == 1)

    def release_expired(
        self, now: datetime, *, limit: int, ids: Sequence[int] | None = None
    ) -> int:
        """Release up to ``limit`` leases that ran out by ``now`` (of ``ids``, if given).

        What the sweeper and the admin's release action do; each call commits on its own.
        Return how many were released.
        """
        with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
            cursor.execute(*self._expired_leases(now, limit, ids))
            return int(cursor.rowcount)

    def _expired_leases(
        self, now: datetime, limit: int, ids: Sequence[int] | None
    ) -> tuple[str, list[Any]]:
        only, params = self.sql.not_left_for_a_person, [self._prep("locked_until", now)]
        if ids is not None:
            only = self.sql.with_ids.format(ids=placeholders(ids) or "NULL")
            params += ids
        return self.sql.release_expired.format(only=only), [*params, limit]


def _advisory_lock(table: str, new: NewKey) -> int:
    """The advisory lock's number for ``new``'s key: 64 bits of a hash of table, scope and key.

    Two keys whose numbers meet only take turns; they never share a row (the unique index on
    scope and key decides that).
    """
    named = "\n".join([table, str(len(new.scope)), new.scope, new.key]).encode()
    digest = hashlib.blake2b(named, digest_size=8, person=b"idempotency-key").digest()
    return int.from_bytes(digest, "big", signed=True)


class PostgreSQLKeyStore(KeyStore):
    """The key table on PostgreSQL, where an atomic-mode run writes its row once, completed.

    ``reserve()`` tries a transaction-scoped advisory lock on the key and reads the row that
    holds it in one statement; while another transaction holds the lock, it looks again until the
    request's wait bound. No claim row, no completion ``UPDATE``, no ``lock_timeout`` set and put
    back: the holder of the lock runs the view, then ``complete()`` inserts the completed row, or
    writes it over the free row it read (see ``statements.postgresql()``). Lease mode, which
    commits its row before the run, claims as on SQLite.
    """

    reserve_reads = True

    def __init__(self, model: type[Model], using: str) -> None:
        super().__init__(model, using)
        if model not in _POSTGRESQL_STATEMENTS:
            _POSTGRESQL_STATEMENTS[model] = statements.postgresql(model, self.connection)
        self.atomic = _POSTGRESQL_STATEMENTS[model]

    def reserve(self, new: NewKey) -> Claim | StoredResponse | Conflict:
        lock = _advisory_lock(self.model._meta.db_table, new)
        deadline = time.monotonic() + new.wait_timeout
        pause = FIRST_POLL_SECONDS
        while True:
            with self.connection.cursor() as cursor:
                cursor.execute(self.atomic.reserve, [lock, new.scope, new.key])
                locked, *fetched = cursor.fetchone()
            row = None if fetched[0] is None else Holder(*fetched)
            if row is not None and not is_free(row, new):
                # A committed row answers: a replay, a refusal, or a live lease's "in progress".
                return self._replay_or_refuse(row, new)
            if locked:
                return self._reserved(row, new)
            # Another transaction holds the key: it commits a row, or rolls back and frees it.
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KeyBusy
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, POLL_SECONDS)

    def _reserved(self, row: Holder | None, new: NewKey) -> Reservation:
        if row is None:
            return Reservation(0, 1, 1, new.expires_at, new)
        if lease_ran_out(row, new):
            self._report_takeover(new)
        # A row that never completed counts one more attempt, as a takeover's claim does.
        attempts = 1 if row.state == "succeeded" else row.attempts + 1
        return Reservation(row.id, row.lease_version + 1, attempts, new.expires_at, new)

    def complete(
        self,
        claim: Claim,
        *,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        now: datetime,
    ) -> bool:
        if not isinstance(claim, Reservation):
            return super().complete(claim, status=status, headers=headers, body=body, now=now)
        written = self._inserted(claim.new)
        written.update(
            state="succeeded", lease_version=claim.lease_version, attempts=claim.attempts
        )
        response = self._response(status, headers, body, now)
        params = [*written.values(), *response, claim.id, claim.lease_version - 1]
        with self.connection.cursor() as cursor:
            cursor.execute(self.atomic.store, params)
            return bool(cursor.rowcount == 1)


class MariaDBKeyStore(KeyStore):
    """The key table on MariaDB, which has neither ``ON CONFLICT`` nor ``UPDATE … RETURNING``.

    A claim inserts the row, or, on a duplicate, locks the row that holds the key (waiting, up to
    the request's wait timeout, for a concurrent request's uncommitted row). Holding that lock,
    it reads the row and decides in Python, as PostgreSQL's statement does in SQL: take an
    expired, failed or lease-lost row over; replay a completed one; or say why neither. No
    statement after the first waits: the row is already this transaction's.
    """

    def __init__(self, model: type[Model], using: str) -> None:
        super().__init__(model, using)
        if model not in _MARIADB_STATEMENTS:
            _MARIADB_STATEMENTS[model] = statements.mariadb(model, self.connection)
        self.more = _MARIADB_STATEMENTS[model]

    def acquire(self, new: NewKey) -> Claim | StoredResponse | Conflict:
        return self._claim(new, replay=True)

    def claim(self, new: NewKey) -> Claim | None:
        found = self._claim(new, replay=False)
        return found if isinstance(found, Claim) else None

    def _claim_params(self, new: NewKey, *, takeover: bool = False) -> list[Any]:
        # innodb_lock_wait_timeout counts whole seconds; 0 does not wait.
        inserted = self._inserted(new)
        return [math.ceil(new.wait_timeout), *(inserted[name] for name in statements.CLAIMED)]

    def _claim(self, new: NewKey, *, replay: bool) -> Claim | StoredResponse | Conflict:
        deadline = time.monotonic() + new.wait_timeout
        with self.connection.cursor() as cursor:
            while True:
                self._insert(cursor, new, deadline)
                if cursor.lastrowid:  # a new row: LAST_INSERT_ID(0) marks a duplicate
                    return Claim(cursor.lastrowid, 1, 1, new.expires_at)
                cursor.execute(self.more.locked_row, [new.scope, new.key])
                fetched = cursor.fetchone()
                if fetched is not None:
                    row = Holder(*fetched)
                    break
                # Unreachable while the insert's lock holds the row; should a purge have taken it
                # in between, the key is new again.
            if is_free(row, new):
                if lease_ran_out(row, new):
                    self._report_takeover(new)
                inserted = self._inserted(new)
                renewed = [inserted[name] for name in statements.RENEWED]
                cursor.execute(self.more.take_over, [*renewed, row.id])
                attempts = 1 if row.state == "succeeded" else row.attempts + 1
                return Claim(row.id, row.lease_version + 1, attempts, new.expires_at)
        if not replay:
            return Conflict(fingerprint_matches=row.fingerprint == new.fingerprint)
        return self._replay_or_refuse(row, new)

    def _insert(self, cursor: Any, new: NewKey, deadline: float) -> None:
        """Insert the key's row, or lock the row that holds it; ``KeyBusy`` if the wait ran out.

        A deadlock is what InnoDB makes of several requests waiting on a row whose insert rolled
        back (the first request failed): it rolls back all but one of them. The engine claims
        first thing in a transaction of its own, so then nothing is lost and the claim is tried
        again; inside an enclosing transaction (ATOMIC_REQUESTS) the request answers "in
        progress", and its client retries.
        """
        while True:
            try:
                cursor.execute(self.sql.claim, self._claim_params(new))
            except OperationalError as exc:
                error = mariadb_error(exc)
                alone = len(self.connection.atomic_blocks) == 1
                if error == DEADLOCK and alone and time.monotonic() < deadline:
                    continue
                if error in (DEADLOCK, LOCK_WAIT_TIMEOUT):
                    raise KeyBusy from exc
                raise
            return

    def release_expired(
        self, now: datetime, *, limit: int, ids: Sequence[int] | None = None
    ) -> int:
        # MariaDB refuses a LIMIT in an IN subquery: the rows are picked, then released.
        def release() -> int:
            with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
                cursor.execute(*self._expired_leases(now, limit, ids))
                return self._apply(cursor, self.more.release_picked)

        return again_after_deadlocks(release, self.connection)

    @staticmethod
    def _apply(cursor: Any, template: str) -> int:
        """Run ``template`` on the ids the cursor's pick locked; return how many there were."""
        picked = [row[0] for row in cursor.fetchall()]
        if picked:
            cursor.execute(template.format(ids=placeholders(picked)), picked)
        return len(picked)


# This process's replays, written to their rows about a second after they were counted.
replay_counts = DeferredCounts(
    lambda model, using, counts: key_store(model, using).write_replay_counts(counts)
)
