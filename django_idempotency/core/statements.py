"""The text of every statement on the ``IdempotencyKey`` table, for each database.

Built once per database from the model's quoted table and column names: only quoted identifiers
are interpolated, every value is a parameter. ``store.py`` runs them; expired keys are deleted
by the batched purge that every table shares (``purging.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from django_idempotency.core.databases import Names, placeholders

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model


# The columns a claim writes, in order.
INSERTED = (
    "scope", "key", "method", "route", "fingerprint", "state", "lease_version",
    "locked_until", "attempts", "created_at", "expires_at", "replay_count",
)  # fmt: skip
# What every new row starts with, written into the statement rather than sent each time.
STARTING = {"state": "'in_progress'", "lease_version": "1", "attempts": "1", "replay_count": "0"}
# The claim's parameters: the other columns, in order.
CLAIMED = tuple(name for name in INSERTED if name not in STARTING)
# What a row taken over on MariaDB is given of the new request's row, in this order.
RENEWED = tuple(
    name for name in INSERTED if name not in {"scope", "key", "lease_version", "attempts"}
)
# What a completion writes, after the columns a claim wrote.
COMPLETED = ("response_status", "response_headers", "response_body", "completed_at")
# What a taken-over row forgets of its previous request.
RESET = ("response_status", "response_headers", "response_body", "completed_at", "last_replayed_at")


class Holder(NamedTuple):
    """What is read of the row that holds a key a request could not insert, by column."""

    id: int
    lease_version: int
    attempts: int
    state: str
    fingerprint: str
    locked_until: Any  # a datetime, or SQLite's text; None unless leased
    # What a replay answers with.
    response_status: int | None
    response_headers: Any  # JSON, or the text of it
    response_body: Any
    replay_count: int
    expires_at: Any


HOLDER = Holder._fields


class Statements(NamedTuple):
    insert: str  # a new key's row, or none (PostgreSQL: a row of NULLs) if a row holds the key
    claim: str  # a new row, or the takeover of an expired, failed or lease-lost one
    holder: str  # the row that holds a key, read without a lock
    count_replays: str
    complete: str
    fail: str
    renew: str
    release_expired: str  # a template: {only} narrows the rows it may pick
    # What {only} is: the leases no person was asked about, or the ones with these ids ({ids}).
    not_left_for_a_person: str
    with_ids: str


class PostgreSQLStatements(NamedTuple):
    """What an atomic-mode request runs on PostgreSQL instead of a claim and a completion."""

    reserve: str  # try the key's advisory lock, and read the row that holds the key
    store: str  # the completed row, inserted, or written over the free row that was read


class MariaDBStatements(NamedTuple):
    """What MariaDB needs besides: a claim's second step, and picks for want of LIMIT in IN."""

    locked_row: str  # the row that holds a key, locked
    take_over: str
    release_picked: str  # a template: {ids}


def build(model: type[Model], connection: BaseDatabaseWrapper) -> Statements:
    """The statements on ``model``'s table for ``connection``'s database."""
    vendor = connection.vendor
    c = Names(model, connection)
    t = c.table
    columns = ", ".join(c(name) for name in INSERTED)
    values = ", ".join(STARTING.get(name, "%s") for name in INSERTED)
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
    # Only a live request renews its lease, and only while its row is still its own.
    renew = (
        f"UPDATE {t} SET {c('locked_until')} = %s "  # noqa: S608
        f"WHERE {c('id')} = %s AND {c('lease_version')} = %s AND {c('state')} = 'in_progress'"
    )
    holder = (
        f"SELECT {', '.join(c(name) for name in HOLDER)} FROM {t} "  # noqa: S608
        f"WHERE {c('scope')} = %s AND {c('key')} = %s"
    )
    # Replays are counted in memory and written in batches (counting.py), to the row they
    # were counted on: a key taken over since then starts afresh.
    count_replays = (
        f"UPDATE {t} SET {c('replay_count')} = {c('replay_count')} + %s, "  # noqa: S608
        f"{c('last_replayed_at')} = CASE WHEN {c('last_replayed_at')} IS NULL "
        f"OR {c('last_replayed_at')} < %s THEN %s ELSE {c('last_replayed_at')} END "
        f"WHERE {c('id')} = %s AND {c('lease_version')} = %s"
    )
    # Releasing a lease whose request died: the row fails, so the next request takes it over
    # (asking the view's recovery hook), and its lease version goes up, so the lost request
    # can no longer store a result. Only leased, unfinished rows carry locked_until: the
    # lease index finds them. Several sweepers at once each take their own rows.
    release = (
        f"UPDATE {t} SET {c('state')} = 'failed', {c('locked_until')} = NULL, "  # noqa: S608
        f"{c('lease_version')} = {c('lease_version')} + 1 WHERE {c('id')} IN "
    )
    pick = f"SELECT {c('id')} FROM {t} WHERE {c('locked_until')} <= %s{{only}} "  # noqa: S608
    pick += f"ORDER BY {c('locked_until')} LIMIT %s"
    # A lease the reconcile hook could not settle waits for a person, who may release it by its
    # id.
    unsettled, version = c("unsettled_lease_version"), c("lease_version")
    filters = {
        "not_left_for_a_person": f" AND ({unsettled} IS NULL OR {unsettled} <> {version})",
        "with_ids": f" AND {c('id')} IN ({{ids}})",
    }
    if vendor == "mysql":
        # See mariadb(); release_expired is the pick of the rows to release.
        claim = (
            "SET STATEMENT innodb_lock_wait_timeout = %s FOR "  # noqa: S608
            f"INSERT INTO {t} ({columns}) VALUES ({values}) "
            f"ON DUPLICATE KEY UPDATE {c('id')} = {c('id')} + LAST_INSERT_ID(0)"
        )
        skip_locked = f"{pick} FOR UPDATE SKIP LOCKED"
        return Statements(
            claim, claim, holder, count_replays, complete, fail, renew, skip_locked, **filters
        )

    # Taking over a row starts it afresh, under a new lease version. A row that never
    # completed (it failed, or its lease ran out) counts one more attempt: its effect may have
    # happened, which is what the view's recovery hook is asked.
    updates = {name: f"EXCLUDED.{c(name)}" for name in INSERTED if name != "key"}
    updates["lease_version"] = f"{t}.{c('lease_version')} + 1"
    updates["attempts"] = (
        f"CASE WHEN {t}.{c('state')} = 'succeeded' THEN 1 ELSE {t}.{c('attempts')} + 1 END"
    )
    updates.update(dict.fromkeys(RESET, "NULL"))
    assignments = ", ".join(f"{c(name)} = {value}" for name, value in updates.items())
    returning = f"RETURNING {c('id')}, {c('lease_version')}, {c('attempts')}"
    # A lease that ran out is taken over by a retry of its request only (see store._free).
    same_request = f"{t}.{c('fingerprint')} = EXCLUDED.{c('fingerprint')}"
    conflict = (
        f"ON CONFLICT ({c('scope')}, {c('key')}) DO UPDATE SET {assignments} "
        f"WHERE {t}.{c('expires_at')} <= %s OR {t}.{c('state')} = 'failed' "
        f"OR ({t}.{c('locked_until')} <= %s AND {same_request}) {returning}"
    )
    inserted = f"INSERT INTO {t} ({columns}) VALUES ({values})"  # noqa: S608
    new_only = f"ON CONFLICT ({c('scope')}, {c('key')}) DO NOTHING {returning}"
    if vendor != "postgresql":
        return Statements(
            f"{inserted} {new_only}",
            f"{inserted} {conflict}",
            holder,
            count_replays,
            complete,
            fail,
            renew,
            f"{release}({pick})",
            **filters,
        )

    # A claim bounds its own wait on a duplicate's uncommitted row with a transaction-local
    # lock_timeout, set before its insert can wait, and puts the previous value back in the same
    # statement (one round trip) whether or not the insert returns a row: a claim that returns
    # none is followed in its transaction by a replay, a refusal or a takeover, and then perhaps
    # the view, none of which may run under the bound (a takeover's claim would even read it as
    # the value to put back). So the restore is in the outer SELECT, a LEFT JOIN from the one row
    # of "previous", which yields its row only once the insert has returned its own or nothing.
    def bounded(insert: str) -> str:
        return (
            "WITH previous AS MATERIALIZED "  # noqa: S608
            "(SELECT current_setting('lock_timeout') AS value), "
            "bounded AS (SELECT set_config('lock_timeout', %s, true) FROM previous), "
            f"claimed AS (INSERT INTO {t} ({columns}) SELECT {values} FROM bounded {insert}) "
            f"SELECT claimed.{c('id')}, claimed.{c('lease_version')}, claimed.{c('attempts')}, "
            "set_config('lock_timeout', previous.value, true) "
            "FROM previous LEFT JOIN claimed ON true"
        )

    return Statements(
        bounded(new_only),
        bounded(conflict),
        holder,
        count_replays,
        complete,
        fail,
        renew,
        f"{release}({pick} FOR UPDATE SKIP LOCKED)",  # another sweeper's batch is its own
        **filters,
    )


def postgresql(model: type[Model], connection: BaseDatabaseWrapper) -> PostgreSQLStatements:
    """An atomic-mode request's two statements on PostgreSQL: no row is written before the view.

    Duplicates take turns on a transaction-scoped advisory lock on the key, tried (never waited
    for: the wait is the engine's, polled and bounded) in the same statement that reads the row
    holding the key. The holder of the lock runs the view and then writes its completed row in
    one statement: an insert, or the takeover of the free row it read, fenced by that row's id
    and lease version. The unique index decides a race that the lock does not see (a request
    that committed between this statement's snapshot and its lock, a lease-mode request, which
    claims a row instead): the write then changes nothing, and the request answers as the row's
    holder. No statement sets lock_timeout; the view runs under the session's own.
    """
    c = Names(model, connection)
    t = c.table
    held = ", ".join(f"held.{c(name)}" for name in HOLDER)
    reserve = (
        f"SELECT pg_try_advisory_xact_lock(%s), {held} FROM (SELECT 1) AS one "  # noqa: S608
        f"LEFT JOIN {t} AS held ON held.{c('scope')} = %s AND held.{c('key')} = %s"
    )
    written = (*INSERTED, *COMPLETED)
    columns = ", ".join(c(name) for name in written)
    updates = ", ".join(
        [
            *(f"{c(name)} = EXCLUDED.{c(name)}" for name in written if name != "key"),
            f"{c('last_replayed_at')} = NULL",
        ]
    )
    store = (
        f"INSERT INTO {t} ({columns}) VALUES ({placeholders(written)}) "  # noqa: S608
        f"ON CONFLICT ({c('scope')}, {c('key')}) DO UPDATE SET {updates} "
        f"WHERE {t}.{c('id')} = %s AND {t}.{c('lease_version')} = %s"
    )
    return PostgreSQLStatements(reserve, store)


def mariadb(model: type[Model], connection: BaseDatabaseWrapper) -> MariaDBStatements:
    """MariaDB has no UPDATE … RETURNING and refuses a subquery on the table a statement changes.

    So a claim is an insert that, on a duplicate, only locks the row that holds the key, and
    tells which happened through LAST_INSERT_ID: the new row's id, or 0. What becomes of the
    locked row (taken over, replayed, refused) is read and decided in a second statement and
    written in a third, none of which waits: the lock is already this transaction's. The
    insert's wait for a concurrent request's uncommitted row is bounded by this statement's
    own innodb_lock_wait_timeout, in whole seconds: SET STATEMENT leaves the session's value to
    every other statement, the view's included.
    """
    c = Names(model, connection)
    t = c.table
    # MariaDB assigns from left to right, each assignment seeing the ones before it: the
    # attempts must be counted before the state is reset.
    take_over = (
        f"UPDATE {t} SET {c('lease_version')} = {c('lease_version')} + 1, "  # noqa: S608
        f"{c('attempts')} = CASE WHEN {c('state')} = 'succeeded' THEN 1 "
        f"ELSE {c('attempts')} + 1 END, "
        + ", ".join(
            [*(f"{c(name)} = %s" for name in RENEWED), *(f"{c(name)} = NULL" for name in RESET)]
        )
        + f" WHERE {c('id')} = %s"
    )
    # By the primary key alone, as the purge does (see purging.py).
    primary = "FORCE INDEX (PRIMARY)"
    by_id = "SET STATEMENT in_predicate_conversion_threshold = 0 FOR"
    return MariaDBStatements(
        locked_row=(
            f"SELECT {', '.join(c(name) for name in HOLDER)} FROM {t} "  # noqa: S608
            f"WHERE {c('scope')} = %s AND {c('key')} = %s FOR UPDATE"
        ),
        take_over=take_over,
        release_picked=(
            f"{by_id} UPDATE {t} {primary} SET {c('state')} = 'failed', "  # noqa: S608
            f"{c('locked_until')} = NULL, {c('lease_version')} = {c('lease_version')} + 1 "
            f"WHERE {c('id')} IN ({{ids}})"
        ),
    )
