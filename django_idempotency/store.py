"""Database operations on ``IdempotencyKey`` rows: claim, replay, complete.

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

from django.db import OperationalError, connections

from django_idempotency.models import IdempotencyKey

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Field

# PostgreSQL SQLSTATE lock_not_available: raised when lock_timeout expires.
LOCK_NOT_AVAILABLE = "55P03"
SUPPORTED_VENDORS = frozenset({"postgresql", "sqlite"})


class KeyBusy(Exception):
    """Another request holds the key and did not finish within the wait bound."""


@dataclass(frozen=True)
class Claim:
    """A key row this request owns until it completes; ``lease_version`` fences the final write."""

    id: int
    lease_version: int
    attempts: int  # above 1: an earlier request with this key did not finish


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


def _is_lock_timeout(exc: OperationalError) -> bool:
    # psycopg 3 names it sqlstate, psycopg2 pgcode. SQLite's "database is locked" is not this:
    # SQLite locks the whole database, so a wait there says nothing about the key.
    cause = exc.__cause__
    return LOCK_NOT_AVAILABLE in (getattr(cause, "sqlstate", None), getattr(cause, "pgcode", None))


def _aware(value: datetime | str) -> datetime:
    # SQLite hands back text in UTC; PostgreSQL an aware datetime.
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", IdempotencyKey._meta.get_field(name))


class _Statements(NamedTuple):
    claim: str
    replay: str
    complete: str
    fail: str


def _build_statements(vendor: str, quote: Callable[[str], str]) -> _Statements:
    """Build the key table's statements: only quoted identifiers are interpolated."""

    def c(name: str) -> str:
        return quote(_field(name).column)

    t = quote(IdempotencyKey._meta.db_table)
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
    if vendor == "postgresql":
        # One round trip: the CTE sets a transaction-local lock_timeout before the insert can
        # wait on a duplicate's uncommitted row, and RETURNING puts the previous value back
        # once the claim is won, so the view's own queries are not bounded by it. A claim that
        # loses (a replay, a mismatch) runs no view and its transaction ends at once; only an
        # enclosing ATOMIC_REQUESTS transaction keeps the bound until the request ends.
        claim = (
            "WITH previous AS (SELECT current_setting('lock_timeout') AS value), "  # noqa: S608
            "bounded AS (SELECT set_config('lock_timeout', %s, true) FROM previous) "
            f"INSERT INTO {t} ({columns}) SELECT {values} FROM bounded {conflict}, "
            "set_config('lock_timeout', (SELECT value FROM previous), true)"
        )
    else:
        claim = f"INSERT INTO {t} ({columns}) VALUES ({values}) {conflict}"  # noqa: S608
    replay = (
        f"UPDATE {t} SET {c('replay_count')} = {c('replay_count')} + 1, "  # noqa: S608
        f"{c('last_replayed_at')} = %s "
        f"WHERE {c('scope')} = %s AND {c('key')} = %s AND {c('state')} = %s "
        f"AND {c('fingerprint')} = %s AND {c('expires_at')} > %s "
        f"RETURNING {c('response_status')}, {c('response_headers')}, {c('response_body')}, "
        f"{c('replay_count')}, {c('expires_at')}"
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
    return _Statements(claim, replay, complete, fail)


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

    def claim(
        self,
        *,
        scope: str,
        key: str,
        method: str,
        route: str,
        fingerprint: str,
        now: datetime,
        expires_at: datetime,
        wait_timeout: float,
        locked_until: datetime | None = None,
    ) -> Claim | None:
        """Insert the key row, or take over one that expired, failed or lost its lease.

        ``None`` if a live row holds the key. Must run inside ``transaction.atomic``. Raises
        ``KeyBusy`` when the wait on a duplicate's uncommitted row is exceeded.
        """
        prepared_now = self._prep("expires_at", now)
        params = [
            scope, key, method, route, fingerprint, IdempotencyKey.State.IN_PROGRESS, 1,
            self._prep("locked_until", locked_until), 1, self._prep("created_at", now),
            self._prep("expires_at", expires_at), 0, prepared_now, prepared_now,
        ]  # fmt: skip
        if self.connection.vendor == "postgresql":
            params.insert(0, f"{max(1, round(wait_timeout * 1000))}ms")
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(self.sql.claim, params)
            except OperationalError as exc:
                if _is_lock_timeout(exc):
                    raise KeyBusy from exc
                raise
            row = cursor.fetchone()
        if row is None:
            return None
        return Claim(id=row[0], lease_version=row[1], attempts=row[2])

    def replay(
        self, *, scope: str, key: str, fingerprint: str, now: datetime
    ) -> StoredResponse | Conflict:
        """Count a replay of the completed row and return its response, or say why not."""
        prepared_now = self._prep("last_replayed_at", now)
        params = [
            prepared_now,
            scope,
            key,
            IdempotencyKey.State.SUCCEEDED,
            fingerprint,
            prepared_now,
        ]
        with self.connection.cursor() as cursor:
            cursor.execute(self.sql.replay, params)
            row = cursor.fetchone()
        if row is not None:
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
        stored_fingerprint = (
            IdempotencyKey.objects.using(self.using)
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
            IdempotencyKey.State.SUCCEEDED,
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
