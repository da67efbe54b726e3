"""What the package's SQL needs to know of the databases it runs on.

Which vendors it supports, how each says that a bounded wait for a row lock ran out or that a
deadlock rolled a transaction back, how a statement names a model's table and columns, and
whether a PostgreSQL connection goes through a pooler. The key store, the inbox and the batched
purges all write their SQL with these.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.db import OperationalError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model

SUPPORTED_VENDORS = frozenset({"postgresql", "sqlite", "mysql"})
# PostgreSQL SQLSTATE lock_not_available: raised when lock_timeout expires.
LOCK_NOT_AVAILABLE = "55P03"
# MariaDB's error numbers: innodb_lock_wait_timeout ran out; a deadlock rolled back the transaction.
LOCK_WAIT_TIMEOUT, DEADLOCK = 1205, 1213


def is_lock_timeout(exc: OperationalError) -> bool:
    """Whether ``exc`` is a bounded wait for a row lock running out.

    PostgreSQL's lock_timeout, with psycopg 3 or psycopg2, or MariaDB's innodb_lock_wait_timeout.
    """
    # psycopg 3 names it sqlstate, psycopg2 pgcode. SQLite's "database is locked" is not this:
    # SQLite locks the whole database, so a wait there says nothing about the row.
    cause = exc.__cause__
    codes = (getattr(cause, "sqlstate", None), getattr(cause, "pgcode", None))
    return LOCK_NOT_AVAILABLE in codes or mariadb_error(exc) == LOCK_WAIT_TIMEOUT


def mariadb_error(exc: OperationalError) -> int | None:
    """The MariaDB error number of ``exc``, if it is one."""
    args = getattr(exc.__cause__, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def again_after_deadlocks(
    work: Callable[[], int], connection: BaseDatabaseWrapper, *, attempts: int = 5
) -> int:
    """Run ``work``, transactions of its own, again when MariaDB rolls one back for a deadlock.

    Two purges or sweeps at once lock rows and their index entries in different orders: InnoDB
    then rolls one back. Nothing was done, so doing it again is safe; but not inside a caller's
    transaction, which the deadlock rolled back as well. On a connection set above READ
    COMMITTED, ``work``'s transactions still run at READ COMMITTED: there InnoDB would also lock
    the gaps between the rows read, and two sweepers would deadlock each other on most batches.
    """
    if connection.in_atomic_block:
        return work()
    with _read_committed(connection):
        for attempt in range(1, attempts + 1):
            try:
                return work()
            except OperationalError as exc:
                if mariadb_error(exc) != DEADLOCK or attempt == attempts:
                    raise
    raise AssertionError  # unreachable: the last attempt returns or raises


@contextmanager
def _read_committed(connection: BaseDatabaseWrapper) -> Iterator[None]:
    """The session at READ COMMITTED meanwhile, on MariaDB set otherwise; as it was after."""
    if connection.vendor != "mysql":
        yield
        return
    connection.ensure_connection()  # the level is known once connected
    if getattr(connection, "isolation_level", None) == "read committed":
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.tx_isolation")
        (level,) = cursor.fetchone()
        cursor.execute("SET SESSION tx_isolation = 'READ-COMMITTED'")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION tx_isolation = %s", [level])


def behind_pooler(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection``, to PostgreSQL, reaches the server through a pooler (PgBouncer).

    A pooler answers the client's startup with a process id of its own, the key of its cancel
    requests; the server's ``pg_backend_pid()`` is then another. Connects if need be; always
    ``False`` on other databases.
    """
    if connection.vendor != "postgresql":
        return False
    connection.ensure_connection()
    announced = connection.connection.info.backend_pid  # psycopg 3, and psycopg2 2.8+
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (actual,) = cursor.fetchone()
    return bool(announced != actual)


class Names:
    """A model's quoted table and column names, as ``connection`` spells them in SQL."""

    def __init__(self, model: type[Model], connection: BaseDatabaseWrapper) -> None:
        self.model = model
        self.quote: Callable[[str], str] = connection.ops.quote_name
        self.table = self.quote(model._meta.db_table)

    def __call__(self, field: str) -> str:
        """The quoted column of the model's field ``field``."""
        column = self.model._meta.get_field(field).column  # type: ignore[union-attr] # a concrete field
        return self.quote(str(column))


def placeholders(values: Sequence[Any]) -> str:
    """One ``%s`` per value, comma-separated, for an ``IN (…)`` list."""
    return ", ".join(["%s"] * len(values))
