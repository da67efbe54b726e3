"""The servers the request benchmark runs on: PostgreSQL, and MariaDB beside it.

PostgreSQL from PGHOST, PGPORT and PGUSER (default 127.0.0.1:5432 as postgres), MariaDB from
MARIADB_HOST, MARIADB_PORT, MARIADB_USER and MARIADB_PASSWORD (default 127.0.0.1:3306 as root, no
password): the same variables as the test settings.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from benchmarks.common import drop_database, dsn, recreate_database

if TYPE_CHECKING:
    from collections.abc import Iterator

# The table of the naive idempotent view (naive.py); "key" is a reserved word on MariaDB.
NAIVE_TABLE = "bench_naive_key"
NAIVE_COLUMNS = (
    "idempotency_key varchar(255) NOT NULL UNIQUE, fingerprint char(64) NOT NULL, status smallint"
)
# The table of the naive inbox (naive.py): an event's id, once.
NAIVE_EVENT_TABLE = "bench_naive_event"


class Database(Protocol):
    """A server: its benchmark databases, their URLs for DATABASE_URL, connections to them."""

    name: str  # as the command line says it
    title: str  # as the tables say it
    # The table that the view the inbox is measured against inserts into.
    bare_table: str
    # The table of the naive idempotent view that the library is measured against.
    naive_table: str
    # The table of the naive inbox that the inbox is measured against.
    naive_event_table: str

    def url(self, database: str) -> str: ...
    def recreate(self, database: str) -> None: ...
    def drop(self, database: str) -> None: ...
    def connect(self, database: str) -> contextlib.AbstractContextManager[Any]: ...
    def version(self) -> str: ...


class PostgreSQL:
    name = "postgresql"
    title = "PostgreSQL"
    bare_table = (
        "CREATE TABLE bench_bare_event (id bigserial PRIMARY KEY, event_id text, payload jsonb)"
    )
    naive_table = (
        f"CREATE TABLE {NAIVE_TABLE} (id bigserial PRIMARY KEY, {NAIVE_COLUMNS}, body bytea)"
    )
    naive_event_table = (
        f"CREATE TABLE {NAIVE_EVENT_TABLE} "
        "(id bigserial PRIMARY KEY, event_id varchar(255) NOT NULL UNIQUE, payload jsonb)"
    )

    def url(self, database: str) -> str:
        host = os.environ.get("PGHOST", "127.0.0.1")
        user = os.environ.get("PGUSER", "postgres")
        return f"postgres://{user}@{host}:{os.environ.get('PGPORT', '5432')}/{database}"

    def recreate(self, database: str) -> None:
        recreate_database(database)

    def drop(self, database: str) -> None:
        drop_database(database)

    @contextlib.contextmanager
    def connect(self, database: str) -> Iterator[Any]:
        """A DB-API connection to ``database``, in autocommit."""
        import psycopg  # noqa: PLC0415 - only the benchmarks need it

        with psycopg.connect(dsn(database), autocommit=True) as connection:
            yield connection

    def version(self) -> str:
        with self.connect("postgres") as connection:
            return scalar(connection, "SHOW server_version").split()[0]  # type: ignore[no-any-return]


class MariaDB:
    name = "mariadb"
    title = "MariaDB"
    bare_table = (
        "CREATE TABLE bench_bare_event "
        "(id bigint AUTO_INCREMENT PRIMARY KEY, event_id longtext, payload json)"
    )
    naive_table = (
        f"CREATE TABLE {NAIVE_TABLE} "
        f"(id bigint AUTO_INCREMENT PRIMARY KEY, {NAIVE_COLUMNS}, body longblob)"
    )
    naive_event_table = (
        f"CREATE TABLE {NAIVE_EVENT_TABLE} "
        "(id bigint AUTO_INCREMENT PRIMARY KEY, event_id varchar(255) NOT NULL UNIQUE, "
        "payload json)"
    )

    def _server(self) -> dict[str, Any]:
        return {
            "host": os.environ.get("MARIADB_HOST", "127.0.0.1"),
            "port": int(os.environ.get("MARIADB_PORT", "3306")),
            "user": os.environ.get("MARIADB_USER", "root"),
            "password": os.environ.get("MARIADB_PASSWORD", ""),
        }

    def url(self, database: str) -> str:
        server = self._server()
        credentials = quote(server["user"], safe="")
        if server["password"]:
            credentials += ":" + quote(server["password"], safe="")
        return f"mysql://{credentials}@{server['host']}:{server['port']}/{database}"

    @contextlib.contextmanager
    def connect(self, database: str | None = None) -> Iterator[Any]:
        """A DB-API connection to ``database`` (to the server alone if none), in autocommit."""
        import MySQLdb  # noqa: PLC0415 - the mariadb extra, needed only for MariaDB

        options = {"database": database} if database else {}
        # LOAD DATA LOCAL INFILE fills the scale benchmark's tables.
        connection = MySQLdb.connect(
            **self._server(), **options, charset="utf8mb4", local_infile=True
        )
        connection.autocommit(True)
        with contextlib.closing(connection):
            yield connection

    def recreate(self, database: str) -> None:
        with self.connect() as connection, connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {database}")
            cursor.execute(
                f"CREATE DATABASE {database} CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
            )

    def drop(self, database: str) -> None:
        with self.connect() as connection, connection.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {database}")

    def version(self) -> str:
        with self.connect() as connection:
            return scalar(connection, "SELECT VERSION()").split("-")[0]  # type: ignore[no-any-return]


DATABASES: dict[str, Database] = {server.name: server for server in (PostgreSQL(), MariaDB())}


def scalar(connection: Any, sql: str, params: list[Any] | None = None) -> Any:
    """The first column of the first row of ``sql``, on either driver."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]
