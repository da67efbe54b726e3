"""Every statement on the ``IdempotencyKey`` table: claim, replay, complete, renew, release, purge.

The unique index on (scope, key) is the only arbiter of races. A claim is one
``INSERT … ON CONFLICT DO UPDATE … WHERE <expired> RETURNING``: it inserts a new row or takes over
an expired one, and returns nothing when a live row holds the key. Inside a transaction a duplicate
blocks on the first request's uncommitted row until that commits or rolls back; on PostgreSQL the
wait is bounded by a transaction-local ``lock_timeout``. SQLite serializes writers instead: the
wait there is the database's busy timeout, and a wait past it is a retryable 503.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from django.apps import apps
from django.db import OperationalError, connections, transaction

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Field

    from django_idempotency.models import IdempotencyKey

# PostgreSQL SQLSTATE lock_not_available: raised when lock_timeout expires.
LOCK_NOT_AVAILABLE = "55P03"
SUPPORTED_VENDORS = frozenset({"postgresql", "sqlite"})


class KeyBusy(Exception):
    """Another request holds the key and did not finish within the wait bound."""


@dataclass(frozen=True, kw_only=True)
class NewKey:
    """The row a request claims: its key, what the request is, and how long it lives."""

    scope: str
    key: str
    method: str
    route: str
    fingerprint: str
    now: datetime
    expires_at: datetime
    wait_timeout: float  # for a concurrent request that holds the key
    locked_until: datetime | None = None  # lease mode


@dataclass(frozen=True)
class Claim:
    """A key row this request owns until it completes; ``lease_version`` fences the final write."""

    id: int
    lease_version: int
    attempts: int  # above 1: an earlier request with this key did not finish
    expires_at: datetime


@dataclass(frozen=True)
class StoredResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    replay_count: int
    expires_at: datetime | None = None


@dataclass(frozen=True)
class Conflict:
    """A live row holds the key and cannot be replayed for this request."""

    fingerprint_matches: bool


# How long a purge batch waits for a row that a request holds (taking that expired key over)
# before it leaves the locked rows of that batch for the next run.
PURGE_LOCK_TIMEOUT = "100ms"


def is_lock_timeout(exc: OperationalError) -> bool:
    """Whether ``exc`` is PostgreSQL's lock_timeout running out, with psycopg 3 or psycopg2."""
    # psycopg 3 names it sqlstate, psycopg2 pgcode. SQLite's "database is locked" is not this:
    # SQLite locks the whole database, so a wait there says nothing about the key.
    cause = exc.__cause__
    return LOCK_NOT_AVAILABLE in (getattr(cause, "sqlstate", None), getattr(cause, "pgcode", None))


def _aware(value: datetime | str) -> datetime:
    # SQLite hands back text in UTC; PostgreSQL an aware datetime.
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _stored(row: tuple[Any, ...]) -> StoredResponse:
    status, headers, body, replay_count, expires_at = row
    if isinstance(headers, str):  # Django loads JSON columns as text
        headers = json.loads(headers)
    return StoredResponse(
        status=status,
        headers=[(name, value) for name, value in headers or []],
        body=bytes(body or b""),
        replay_count=replay_count,
        expires_at=_aware(expires_at),
    )


def _model() -> type[IdempotencyKey]:
    # Looked up, not imported: the model's manager builds on this module.
    return cast("type[IdempotencyKey]", apps.get_model("django_idempotency", "IdempotencyKey"))


def _field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", _model()._meta.get_field(name))


class _Statements(NamedTuple):
    claim: str
    replay: str
    replay_relaxed: str
    claim_or_replay: str | None  # PostgreSQL only
    claim_or_replay_relaxed: str | None
    complete: str
    fail: str
    renew: str
    release_expired: str  # a template: {only} narrows the rows it may pick
    purge_range: str
    purge_range_bounded: str | None  # PostgreSQL only
    purge_range_skip_locked: str | None


def _build_statements(vendor: str, quote: Callable[[str], str]) -> _Statements:
    """Build the key table's statements: only quoted identifiers are interpolated."""

    def c(name: str) -> str:
        return quote(_field(name).column)

    t = quote(_model()._meta.db_table)
    inserted = [
        "scope", "key", "method", "route", "fingerprint", "state", "lease_version",
        "locked_until", "attempts", "created_at", "expires_at", "replay_count",
    ]  # fmt: skip
    reset = [
        "response_status", "response_headers", "response_body", "completed_at",
        "last_replayed_at",
    ]  # fmt: skip
    # Taking over a row starts it afresh, under a new lease version. A row that never
    # completed (it failed, or its lease ran out) counts one more attempt: its effect may have
    # happened, which is what the view's recovery hook is asked.
    updates = {name: f"EXCLUDED.{c(name)}" for name in inserted if name != "key"}
    updates["lease_version"] = f"{t}.{c('lease_version')} + 1"
    updates["attempts"] = (
        f"CASE WHEN {t}.{c('state')} = 'succeeded' THEN 1 ELSE {t}.{c('attempts')} + 1 END"
    )
    updates.update(dict.fromkeys(reset, "NULL"))
    assignments = ", ".join(f"{c(name)} = {value}" for name, value in updates.items())
    columns = ", ".join(c(name) for name in inserted)
    values = ", ".join(["%s"] * len(inserted))
    conflict = (
        f"ON CONFLICT ({c('scope')}, {c('key')}) DO UPDATE SET {assignments} "
        f"WHERE {t}.{c('expires_at')} <= %s OR {t}.{c('state')} = 'failed' "
        f"OR {t}.{c('locked_until')} <= %s "
        f"RETURNING {c('id')}, {c('lease_version')}, {c('attempts')}"
    )
    # The lease version fences the write: a request whose row was taken over changes nothing.
    complete = (
        f"UPDATE {t} SET {c('state')} = %s, {c('response_status')} = %s, "  # noqa: S608
        f"{c('response_headers')} = %s, {c('response_body')} = %s, {c('completed_at')} = %s, "
        f"{c('locked_until')} = NULL WHERE {c('id')} = %s AND {c('lease_version')} = %s"
    )
    fail = (
        f"UPDATE {t} SET {c('state')} = 'failed', {c('locked_until')} = NULL "  # noqa: S608
        f"WHERE {c('id')} = %s AND {c('lease_version')} = %s"
    )
    # Releasing a lease whose request died: the row fails, so the next request takes it over
    # (asking the view's recovery hook), and its lease version goes up, so the lost request
    # can no longer store a result. Only leased, unfinished rows carry locked_until: the
    # partial lease index finds them. Several sweepers at once each take their own rows.
    pick = f"SELECT {c('id')} FROM {t} WHERE {c('locked_until')} <= %s{{only}} "  # noqa: S608
    pick += f"ORDER BY {c('locked_until')} LIMIT %s"
    if vendor == "postgresql":
        pick += " FOR UPDATE SKIP LOCKED"  # another sweeper's batch is its own
    release_expired = (
        f"UPDATE {t} SET {c('state')} = 'failed', {c('locked_until')} = NULL, "  # noqa: S608
        f"{c('lease_version')} = {c('lease_version')} + 1 WHERE {c('id')} IN ({pick})"
    )
    # Our own DELETE, not QuerySet.delete(): Django's collector would load every row into
    # Python as soon as a project connects a post_delete receiver to this model.
    in_range = f"{c('id')} >= %s AND {c('id')} < %s AND {c('expires_at')} <= %s"
    purge_range = f"DELETE FROM {t} WHERE {in_range}"  # noqa: S608
    # A row a purge finds locked belongs to a request taking that expired key over, which may
    # hold it for the whole view: wait a moment (the CTE bounds the wait before any row is
    # locked), then skip the locked rows of the range, so that no batch holds locks for long.
    purge_range_bounded = (
        "WITH bounded AS (SELECT set_config('lock_timeout', %s, true)) "  # noqa: S608
        f"{purge_range} AND EXISTS (SELECT FROM bounded)"
    )
    purge_range_skip_locked = (
        f"DELETE FROM {t} WHERE {c('id')} IN (SELECT {c('id')} FROM {t} "  # noqa: S608
        f"WHERE {in_range} FOR UPDATE SKIP LOCKED)"
    )
    # Only a live request renews its lease, and only while its row is still its own.
    renew = (
        f"UPDATE {t} SET {c('locked_until')} = %s "  # noqa: S608
        f"WHERE {c('id')} = %s AND {c('lease_version')} = %s AND {c('state')} = 'in_progress'"
    )
    replay = (
        f"UPDATE {t} SET {c('replay_count')} = {c('replay_count')} + 1, "  # noqa: S608
        f"{c('last_replayed_at')} = %s "
        f"WHERE {c('scope')} = %s AND {c('key')} = %s AND {c('state')} = %s "
        f"AND {c('fingerprint')} = %s AND {c('expires_at')} > %s "
        f"RETURNING {c('response_status')}, {c('response_headers')}, {c('response_body')}, "
        f"{c('replay_count')}, {c('expires_at')}"
    )
    # A replay writes nothing but its count, and losing a count in a crash is harmless: on
    # PostgreSQL its transaction may commit without waiting for the WAL flush, which is most of
    # what a replay would otherwise cost.
    relax = "set_config('synchronous_commit', 'off', true)"
    replay_relaxed = f"{replay}, {relax}" if vendor == "postgresql" else replay
    if vendor != "postgresql":
        claim = f"INSERT INTO {t} ({columns}) VALUES ({values}) {conflict}"  # noqa: S608
        return _Statements(
            claim, replay, replay_relaxed, None, None, complete, fail, renew,
            release_expired, purge_range, None, None,
        )  # fmt: skip
    # One round trip: the CTE sets a transaction-local lock_timeout before the insert can wait
    # on a duplicate's uncommitted row, and RETURNING puts the previous value back once the
    # claim is won, so the view's own queries are not bounded by it. A claim that loses (a
    # replay, a mismatch) runs no view and its transaction ends at once; only an enclosing
    # ATOMIC_REQUESTS transaction keeps the bound until the request ends.
    bounded_insert = (
        "WITH previous AS (SELECT current_setting('lock_timeout') AS value), "
        "bounded AS (SELECT set_config('lock_timeout', %s, true) FROM previous)"
    )
    restore = "set_config('lock_timeout', (SELECT value FROM previous), true)"
    claim = (
        f"{bounded_insert} INSERT INTO {t} ({columns}) SELECT {values} "  # noqa: S608
        f"FROM bounded {conflict}, {restore}"
    )

    # The claim and the replay in one round trip: the UPDATE runs only if the INSERT claimed
    # nothing, and finds the row if it was committed before the statement began. A row that a
    # concurrent request committed while the INSERT waited for it is not in the statement's
    # snapshot: then the replay is left to a second statement.
    # Its last column is selected so that the function runs.
    update, returning = replay.split(" RETURNING ", 1)

    def claim_or_replay(last: str) -> str:
        return (
            f"{bounded_insert}, claimed AS (INSERT INTO {t} ({columns}) "  # noqa: S608
            f"SELECT {values} FROM bounded {conflict}, {restore} AS done), "
            f"replayed AS ({update} AND NOT EXISTS (SELECT FROM claimed) "
            f"RETURNING {returning}) "
            f"SELECT {c('id')}, {c('lease_version')}, {c('attempts')}, "
            "NULL, NULL, NULL, NULL, NULL, done FROM claimed UNION ALL "
            f"SELECT NULL, NULL, NULL, {c('response_status')}, {c('response_headers')}, "
            f"{c('response_body')}, {c('replay_count')}, {c('expires_at')}, {last} FROM replayed"
        )

    return _Statements(
        claim,
        replay,
        replay_relaxed,
        claim_or_replay("NULL"),
        claim_or_replay(relax),
        complete,
        fail,
        renew,
        release_expired,
        purge_range,
        purge_range_bounded,
        purge_range_skip_locked,
    )


# Built once per database vendor, not per request.
_STATEMENTS: dict[str, _Statements] = {}


class KeyStore:
    """The key table's queries on one database alias; cheap to create for each request."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.connection: BaseDatabaseWrapper = connections[using]
        vendor = self.connection.vendor
        if vendor not in _STATEMENTS:
            _STATEMENTS[vendor] = _build_statements(vendor, self.connection.ops.quote_name)
        self.sql = _STATEMENTS[vendor]

    def _prep(self, name: str, value: Any) -> Any:
        return _field(name).get_db_prep_save(value, self.connection)

    def acquire(
        self, new: NewKey, *, relaxed_commit: bool = False
    ) -> Claim | StoredResponse | Conflict:
        """Claim the key; or replay the completed row that holds it; or say why neither can be.

        Must run inside ``transaction.atomic``. Raises ``KeyBusy`` when the wait on a concurrent
        request's uncommitted row is exceeded. ``relaxed_commit`` as for ``replay()``.
        """
        sql = self.sql.claim_or_replay_relaxed if relaxed_commit else self.sql.claim_or_replay
        if sql is None:  # SQLite: a data-modifying statement cannot be a CTE there
            found: Claim | StoredResponse | None = self.claim(new)
        else:
            replay = self._replay_params(new.scope, new.key, new.fingerprint, new.now)
            row = self._fetch(sql, [*self._claim_params(new), *replay])
            found = None
            if row is not None and row[0] is not None:
                found = Claim(row[0], row[1], row[2], new.expires_at)
            elif row is not None:
                found = _stored(row[3:8])
        if found is not None:
            return found
        # A live row holds the key, or a concurrent request committed it while this statement
        # waited (then it is not in the statement's snapshot): a second look tells which.
        return self.replay(
            scope=new.scope,
            key=new.key,
            fingerprint=new.fingerprint,
            now=new.now,
            relaxed_commit=relaxed_commit,
        )

    def claim(self, new: NewKey) -> Claim | None:
        """Insert the key row, or take over one that expired, failed or lost its lease.

        ``None`` if a live row holds the key. Must run inside ``transaction.atomic``. Raises
        ``KeyBusy`` when the wait on a duplicate's uncommitted row is exceeded.
        """
        row = self._fetch(self.sql.claim, self._claim_params(new))
        if row is None:
            return None
        return Claim(row[0], row[1], row[2], new.expires_at)

    def _claim_params(self, new: NewKey) -> list[Any]:
        prepared_now = self._prep("expires_at", new.now)
        params = [
            new.scope, new.key, new.method, new.route, new.fingerprint,
            "in_progress", 1, self._prep("locked_until", new.locked_until), 1,
            self._prep("created_at", new.now), self._prep("expires_at", new.expires_at), 0,
            prepared_now, prepared_now,
        ]  # fmt: skip
        if self.connection.vendor == "postgresql":
            # PostgreSQL reads a lock_timeout of 0 as "wait forever": the shortest wait is 1 ms.
            params.insert(0, f"{max(1, round(new.wait_timeout * 1000))}ms")
        return params

    def _replay_params(self, scope: str, key: str, fingerprint: str, now: datetime) -> list[Any]:
        prepared_now = self._prep("last_replayed_at", now)
        return [prepared_now, scope, key, "succeeded", fingerprint, prepared_now]

    def _fetch(self, sql: str, params: list[Any]) -> tuple[Any, ...] | None:
        """Run a claiming statement; ``KeyBusy`` if its wait on a duplicate timed out."""
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(sql, params)
            except OperationalError as exc:
                if is_lock_timeout(exc):
                    raise KeyBusy from exc
                raise
            return cast("tuple[Any, ...] | None", cursor.fetchone())

    def replay(
        self,
        *,
        scope: str,
        key: str,
        fingerprint: str,
        now: datetime,
        relaxed_commit: bool = False,
    ) -> StoredResponse | Conflict:
        """Count a replay of the completed row and return its response, or say why not.

        ``relaxed_commit``: nothing else is written in this transaction, so its commit need not
        wait for the disk (the count is all it would lose in a crash).
        """
        params = self._replay_params(scope, key, fingerprint, now)
        sql = self.sql.replay_relaxed if relaxed_commit else self.sql.replay
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is not None:
            return _stored(row[:5])
        stored_fingerprint = (
            _model()
            .objects.using(self.using)
            .filter(scope=scope, key=key)
            .values_list("fingerprint", flat=True)
            .first()
        )
        return Conflict(fingerprint_matches=stored_fingerprint in (None, fingerprint))

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
        params = [
            "succeeded",
            status,
            self._prep("response_headers", headers),
            self._prep("response_body", body),
            self._prep("completed_at", now),
            claim.id,
            claim.lease_version,
        ]
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.complete, params)
            return bool(cursor.rowcount == 1)

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
        only, params = "", [self._prep("locked_until", now)]
        if ids is not None:
            column = self.connection.ops.quote_name(_field("id").column)
            only = f" AND {column} IN ({', '.join(['%s'] * len(ids)) or 'NULL'})"
            params += ids
        with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
            cursor.execute(self.sql.release_expired.format(only=only), [*params, limit])
            return int(cursor.rowcount)

    def purge_range(self, low: int, high: int, now: datetime) -> int:
        """Delete the expired rows with ``low <= id < high``, in a transaction of their own."""
        params = [low, high, self._prep("expires_at", now)]
        if self.sql.purge_range_bounded is None:
            with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
                cursor.execute(self.sql.purge_range, params)
                return int(cursor.rowcount)
        # A plain range delete is the fastest; only a locked row makes it wait.
        try:
            with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
                cursor.execute(self.sql.purge_range_bounded, [PURGE_LOCK_TIMEOUT, *params])
                return int(cursor.rowcount)
        except OperationalError as exc:
            if not is_lock_timeout(exc):
                raise
        assert self.sql.purge_range_skip_locked is not None  # noqa: S101 - PostgreSQL's
        with transaction.atomic(using=self.using), self.connection.cursor() as cursor:
            cursor.execute(self.sql.purge_range_skip_locked, params)
            return int(cursor.rowcount)
