"""The text of every statement on the ``IdempotencyKey`` table, for each database.

Built once per database vendor from the model's quoted table and column names: only quoted
identifiers are interpolated, every value is a parameter. ``store.py`` runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, cast

from django.apps import apps

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.models import Field

    from django_idempotency.models import IdempotencyKey


def key_model() -> type[IdempotencyKey]:
    # Looked up, not imported: the model's manager builds on the store.
    return cast("type[IdempotencyKey]", apps.get_model("django_idempotency", "IdempotencyKey"))


def key_field(name: str) -> Field[Any, Any]:
    return cast("Field[Any, Any]", key_model()._meta.get_field(name))


# The columns a claim writes, in the order of its parameters.
INSERTED = (
    "scope", "key", "method", "route", "fingerprint", "state", "lease_version",
    "locked_until", "attempts", "created_at", "expires_at", "replay_count",
)  # fmt: skip
# What a row taken over on MariaDB is given of the new request's row, in this order.
RENEWED = tuple(
    name for name in INSERTED if name not in {"scope", "key", "lease_version", "attempts"}
)
# What a taken-over row forgets of its previous request.
RESET = ("response_status", "response_headers", "response_body", "completed_at", "last_replayed_at")
# What a replay returns, in this order.
RESPONSE = ("response_status", "response_headers", "response_body", "replay_count", "expires_at")


class Statements(NamedTuple):
    claim: str
    replay: str
    replay_relaxed: str
    complete: str
    fail: str
    renew: str
    release_expired: str  # a template: {only} narrows the rows it may pick
    purge_range: str
    # PostgreSQL: the claim and the replay in one round trip; a purge that waits only a moment.
    claim_or_replay: str | None = None
    claim_or_replay_relaxed: str | None = None
    purge_range_bounded: str | None = None
    purge_range_skip_locked: str | None = None


class MariaDBStatements(NamedTuple):
    """What MariaDB needs besides: a claim's second step, and picks for want of LIMIT in IN."""

    locked_row: str  # the row that holds a key, locked
    take_over: str
    count_replay: str
    stored: str  # the response a replay returns
    release_picked: str  # a template: {ids}
    purge_pick: str
    purge_picked: str  # a template: {ids}


def build(vendor: str, quote: Callable[[str], str]) -> Statements:
    """The key table's statements for ``vendor`` ("postgresql", "sqlite" or "mysql")."""

    def c(name: str) -> str:
        return quote(key_field(name).column)

    t = quote(key_model()._meta.db_table)
    columns = ", ".join(c(name) for name in INSERTED)
    values = ", ".join(["%s"] * len(INSERTED))
    response = ", ".join(c(name) for name in RESPONSE)
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
    replay = (
        f"UPDATE {t} SET {c('replay_count')} = {c('replay_count')} + 1, "  # noqa: S608
        f"{c('last_replayed_at')} = %s "
        f"WHERE {c('scope')} = %s AND {c('key')} = %s AND {c('state')} = %s "
        f"AND {c('fingerprint')} = %s AND {c('expires_at')} > %s"
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
    # Our own DELETE, not QuerySet.delete(): Django's collector would load every row into
    # Python as soon as a project connects a post_delete receiver to this model.
    in_range = f"{c('id')} >= %s AND {c('id')} < %s AND {c('expires_at')} <= %s"
    purge_range = f"DELETE FROM {t} WHERE {in_range}"  # noqa: S608
    if vendor == "mysql":
        # See mariadb(); release_expired is the pick of the rows to release.
        claim = (
            "SET STATEMENT innodb_lock_wait_timeout = %s FOR "  # noqa: S608
            f"INSERT INTO {t} ({columns}) VALUES ({values}) "
            f"ON DUPLICATE KEY UPDATE {c('id')} = {c('id')} + LAST_INSERT_ID(0)"
        )
        skip_locked = f"{pick} FOR UPDATE SKIP LOCKED"
        return Statements(claim, replay, replay, complete, fail, renew, skip_locked, purge_range)

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
    conflict = (
        f"ON CONFLICT ({c('scope')}, {c('key')}) DO UPDATE SET {assignments} "
        f"WHERE {t}.{c('expires_at')} <= %s OR {t}.{c('state')} = 'failed' "
        f"OR {t}.{c('locked_until')} <= %s "
        f"RETURNING {c('id')}, {c('lease_version')}, {c('attempts')}"
    )
    replay += f" RETURNING {response}"
    if vendor != "postgresql":
        claim = f"INSERT INTO {t} ({columns}) VALUES ({values}) {conflict}"  # noqa: S608
        return Statements(
            claim, replay, replay, complete, fail, renew, f"{release}({pick})", purge_range
        )
    # A replay writes nothing but its count, and losing a count in a crash is harmless: on
    # PostgreSQL its transaction may commit without waiting for the WAL flush, which is most of
    # what a replay would otherwise cost.
    relax = "set_config('synchronous_commit', 'off', true)"
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
            f"SELECT NULL, NULL, NULL, {response}, {last} FROM replayed"
        )

    # A row a purge finds locked belongs to a request taking that expired key over, which may
    # hold it for the whole view: wait a moment (the CTE bounds the wait before any row is
    # locked), then skip the locked rows of the range, so that no batch holds locks for long.
    return Statements(
        claim,
        replay,
        f"{replay}, {relax}",
        complete,
        fail,
        renew,
        f"{release}({pick} FOR UPDATE SKIP LOCKED)",  # another sweeper's batch is its own
        purge_range,
        claim_or_replay=claim_or_replay("NULL"),
        claim_or_replay_relaxed=claim_or_replay(relax),
        purge_range_bounded=(
            "WITH bounded AS (SELECT set_config('lock_timeout', %s, true)) "  # noqa: S608
            f"{purge_range} AND EXISTS (SELECT FROM bounded)"
        ),
        purge_range_skip_locked=(
            f"DELETE FROM {t} WHERE {c('id')} IN (SELECT {c('id')} FROM {t} "  # noqa: S608
            f"WHERE {in_range} FOR UPDATE SKIP LOCKED)"
        ),
    )


def mariadb(quote: Callable[[str], str]) -> MariaDBStatements:
    """MariaDB has no UPDATE … RETURNING and refuses a subquery on the table a statement changes.

    So a claim is an insert that, on a duplicate, only locks the row that holds the key, and
    tells which happened through LAST_INSERT_ID: the new row's id, or 0. What becomes of the
    locked row (taken over, replayed, refused) is read and decided in a second statement and
    written in a third, none of which waits: the lock is already this transaction's. The
    insert's wait for a concurrent request's uncommitted row is bounded by this statement's
    own innodb_lock_wait_timeout, in whole seconds.
    """

    def c(name: str) -> str:
        return quote(key_field(name).column)

    t = quote(key_model()._meta.db_table)
    response = ", ".join(c(name) for name in RESPONSE)
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
    in_range = f"{c('id')} >= %s AND {c('id')} < %s AND {c('expires_at')} <= %s"
    return MariaDBStatements(
        locked_row=(
            f"SELECT {c('id')}, {c('lease_version')}, {c('attempts')}, {c('state')}, "  # noqa: S608
            f"{c('fingerprint')}, {c('locked_until')}, {response} FROM {t} "
            f"WHERE {c('scope')} = %s AND {c('key')} = %s FOR UPDATE"
        ),
        take_over=take_over,
        count_replay=(
            f"UPDATE {t} SET {c('replay_count')} = {c('replay_count')} + 1, "  # noqa: S608
            f"{c('last_replayed_at')} = %s WHERE {c('id')} = %s"
        ),
        stored=f"SELECT {response} FROM {t} WHERE {c('scope')} = %s AND {c('key')} = %s",  # noqa: S608
        release_picked=(
            f"UPDATE {t} SET {c('state')} = 'failed', {c('locked_until')} = NULL, "  # noqa: S608
            f"{c('lease_version')} = {c('lease_version')} + 1 WHERE {c('id')} IN ({{ids}})"
        ),
        purge_pick=f"SELECT {c('id')} FROM {t} WHERE {in_range} FOR UPDATE SKIP LOCKED",  # noqa: S608
        purge_picked=f"DELETE FROM {t} WHERE {c('id')} IN ({{ids}})",  # noqa: S608
    )
