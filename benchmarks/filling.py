"""Fill the key table and the inbox with realistic rows, by each database's bulk path, and measure
what the rows cost on disk.

The rows are copies of real ones: the key row that the example's payment view stored for the
benchmark's replay key, and a delivered webhook like the benchmark's. Each copy gets its own key
(a random UUID, as clients send them), one of 10,000 users, its own fingerprint and times that grow
with its id. A tenth of the rows have expired and wait for the purge (a day's worth of ten); the
rest expire within the TTL. Of the keys, 94 % succeeded, 5 % failed (stored 4xx answers) and 1 %
are in progress with a lease, as a table under traffic holds them; of the events, 98 % were
processed and 2 % are dead.

PostgreSQL takes the rows by COPY, MariaDB by LOAD DATA LOCAL INFILE. Either way the
table's secondary indexes are dropped first and built again afterwards, as a restore does, and
the table is analyzed. The outbox gets dispatched messages, for their size on disk.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

KEYS = "django_idempotency_idempotencykey"
INBOX = "django_idempotency_inboxevent"
OUTBOX = "django_idempotency_outboxmessage"
USERS = 10_000
CHUNK = 100_000  # rows per LOAD DATA: more would outgrow the lock table of a small buffer pool
BINARY_COLUMNS = {"response_body"}
Row = tuple[Any, ...]

KEY_COLUMNS = (
    "scope", "key", "method", "route", "fingerprint", "state", "lease_version", "locked_until",
    "attempts", "response_status", "response_headers", "response_body", "created_at",
    "completed_at", "expires_at", "replay_count",
)  # fmt: skip
INBOX_COLUMNS = (
    "source", "event_id", "event_type", "payload", "payload_hash", "headers", "status",
    "attempts", "received_at", "processed_at", "last_error", "last_traceback", "deliveries",
    "conflicting_payload_hash", "conflicts",
)  # fmt: skip
OUTBOX_COLUMNS = (
    "message_id", "topic", "payload", "headers", "ordering_key", "status", "attempts",
    "created_at", "next_attempt_at", "dispatched_at", "last_error",
)  # fmt: skip


def quote(vendor: str, name: str) -> str:
    return f"`{name}`" if vendor == "mariadb" else f'"{name}"'


def key_template(connection: Any, key: str) -> dict[str, Any]:
    """The stored row of ``key``: what the copies take their answer from."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT scope, method, route, response_status, response_headers, response_body "
            f"FROM {KEYS} WHERE {quote(vendor_of(connection), 'key')} = %s",
            [key],
        )
        scope, method, route, status, headers, body = cursor.fetchone()
    if not isinstance(headers, str):
        headers = json.dumps(headers)
    # "user:7 POST payments/" -> "user:{} POST payments/"
    return {
        "scope": re.sub(r"^(\w+):\S+", r"\1:{}", scope),
        "method": method,
        "route": route,
        "status": status,
        "headers": headers,
        "body": bytes(body),
    }


def vendor_of(connection: Any) -> str:
    return "postgresql" if type(connection).__module__.startswith("psycopg") else "mariadb"


def key_rows(template: dict[str, Any], count: int, *, expired: float = 0.1) -> Iterator[Row]:
    """``count`` key rows like ``template``: the first ``expired`` share expired a while ago."""
    now = dt.datetime.now(dt.UTC)
    ttl = dt.timedelta(hours=24)
    past = int(count * expired)
    body, headers = template["body"], template["headers"]
    for n in range(count):
        # The expired rows are the oldest (created 2 days to 1 day ago), the others spread over
        # the last day: ids and times grow together, as traffic writes them.
        span = (n / past if n < past else 1 + (n - past) / max(count - past, 1)) - 2
        created = now + span * ttl
        key = str(uuid.UUID(bytes=os.urandom(16), version=4))
        fingerprint = os.urandom(32).hex()
        scope = template["scope"].format(n % USERS + 1)
        kind = n % 100
        if kind == 0:  # in progress, leased
            yield (scope, key, template["method"], template["route"], fingerprint,
                   "in_progress", 1, created + dt.timedelta(seconds=30), 1, None, None, None,
                   created, None, created + ttl, 0)  # fmt: skip
        elif kind <= 5:  # a stored 4xx
            yield (scope, key, template["method"], template["route"], fingerprint, "failed", 1,
                   None, 1, 422, headers, b'{"code":"card_declined"}', created, created,
                   created + ttl, 0)  # fmt: skip
        else:
            yield (scope, key, template["method"], template["route"], fingerprint, "succeeded",
                   1, None, 1, template["status"], headers, body, created, created,
                   created + ttl, int(n % 7 == 0))  # fmt: skip


def inbox_rows(count: int) -> Iterator[Row]:
    """``count`` delivered events from one provider, as the inbox keeps them after processing."""
    now = dt.datetime.now(dt.UTC)
    headers = json.dumps({"Content-Type": "application/json", "User-Agent": "Stripe/1.0"})
    prefix = os.urandom(4).hex()
    for n in range(count):
        received = now - dt.timedelta(seconds=(count - n) * 0.05)
        event_id = f"evt_{prefix}_{n}"
        payload = json.dumps(
            {
                "id": event_id,
                "type": "refund.succeeded",
                "data": {"refund": n, "sequence": 1, "amount": 1250, "currency": "eur"},
            }
        )
        dead = n % 50 == 0
        status, attempts, processed, error = (
            ("dead", 10, None, "TimeoutError") if dead else ("processed", 1, received, "")
        )
        yield ("stripe", event_id, "refund.succeeded", payload, os.urandom(32).hex(), headers,
               status, attempts, received, processed, error, "", 1, "", 0)  # fmt: skip


def outbox_rows(count: int) -> Iterator[Row]:
    """``count`` messages as the outbox keeps them after dispatching: an order's event each."""
    now = dt.datetime.now(dt.UTC)
    headers = json.dumps({"content-type": "application/json"})
    for n in range(count):
        created = now - dt.timedelta(seconds=(count - n) * 0.05)
        payload = json.dumps({"order": n, "status": "paid", "amount": 1250, "currency": "EUR"})
        yield (str(uuid.UUID(bytes=os.urandom(16), version=4)), "orders.paid", payload, headers,
               f"order-{n}", "dispatched", 1, created, None, created, "")  # fmt: skip


def fill(connection: Any, table: str, columns: tuple[str, ...], rows: Iterator[Row]) -> float:
    """Write ``rows`` into ``table`` by the bulk path, its secondary indexes dropped and built
    again afterwards; analyze it. Return the seconds it took."""
    started = time.monotonic()
    vendor = vendor_of(connection)
    indexes = secondary_indexes(connection, table)
    drop_indexes(connection, table, indexes)
    names = ", ".join(quote(vendor, column) for column in columns)
    if vendor == "postgresql":
        with (
            connection.cursor() as cursor,
            cursor.copy(f"COPY {table} ({names}) FROM STDIN") as copy,
        ):
            for row in rows:
                copy.write_row(row)
    else:
        load_data(connection, table, columns, rows)
    create_indexes(connection, table, indexes)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {'TABLE ' if vendor == 'mariadb' else ''}{table}")
        if vendor == "mariadb":
            cursor.fetchall()
    return time.monotonic() - started


def load_data(connection: Any, table: str, columns: tuple[str, ...], rows: Iterator[Row]) -> None:
    """MariaDB's bulk path: the rows as a tab-separated file, read by LOAD DATA LOCAL INFILE in
    chunks of CHUNK rows. Bytes go as hex and are unhexed on the way in."""
    names, assignments = [], []
    for column in columns:
        if column in BINARY_COLUMNS:
            names.append(f"@{column}")
            assignments.append(f"{quote('mariadb', column)} = UNHEX(@{column})")
        else:
            names.append(quote("mariadb", column))
    sql = f"LOAD DATA LOCAL INFILE %s INTO TABLE {table} ({', '.join(names)})" + (
        f" SET {', '.join(assignments)}" if assignments else ""
    )
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "rows.tsv"
        more = True
        while more:
            more = False
            with path.open("w") as handle:
                for count, row in enumerate(rows, 1):
                    handle.write("\t".join(map(tsv, row)) + "\n")
                    if count == CHUNK:
                        more = True
                        break
            with connection.cursor() as cursor:
                cursor.execute(sql, [str(path)])


def tsv(value: Any) -> str:
    """``value`` as LOAD DATA reads it by default: NULL as \\N, bytes as hex, times in UTC."""
    if value is None:
        return "\\N"
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    return str(value).replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def secondary_indexes(connection: Any, table: str) -> list[tuple[str, str]]:
    """(name, how to build it again) of each index of ``table`` but its primary key."""
    with connection.cursor() as cursor:
        if vendor_of(connection) == "postgresql":
            cursor.execute(
                "SELECT i.indexrelid::regclass::text, coalesce("
                " (SELECT 'ALTER TABLE ' || %s || ' ADD CONSTRAINT ' || c.conname || ' '"
                "  || pg_get_constraintdef(c.oid) FROM pg_constraint c"
                "  WHERE c.conindid = i.indexrelid AND c.contype = 'u'),"
                " pg_get_indexdef(i.indexrelid)) "
                "FROM pg_index i WHERE i.indrelid = %s::regclass AND NOT i.indisprimary",
                [table, table],
            )
            return list(cursor.fetchall())
        cursor.execute(f"SHOW CREATE TABLE {table}")
        definition = cursor.fetchone()[1]
    return [
        (match.group(2), match.group(1))
        for match in re.finditer(r"^\s*((?:UNIQUE )?KEY `(\w+)` \(.*\)),?$", definition, re.M)
    ]


def drop_indexes(connection: Any, table: str, indexes: list[tuple[str, str]]) -> None:
    with connection.cursor() as cursor:
        for name, definition in indexes:
            if vendor_of(connection) == "mariadb":
                cursor.execute(f"ALTER TABLE {table} DROP INDEX {name}")
            elif definition.startswith("ALTER TABLE"):
                cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
            else:
                cursor.execute(f"DROP INDEX {name}")


def create_indexes(connection: Any, table: str, indexes: list[tuple[str, str]]) -> None:
    with connection.cursor() as cursor:
        if vendor_of(connection) == "mariadb":
            if indexes:
                additions = ", ".join(f"ADD {definition}" for _, definition in indexes)
                cursor.execute(f"ALTER TABLE {table} {additions}")
            return
        for _, definition in indexes:
            cursor.execute(definition)


def sizes(connection: Any, table: str) -> dict[str, Any]:
    """The rows of ``table`` and the bytes of its heap (with TOAST) and of each index."""
    vendor = vendor_of(connection)
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(
                "SELECT reltuples::bigint, pg_table_size(%s::regclass) FROM pg_class "
                "WHERE oid = %s::regclass",
                [table, table],
            )
            rows, heap = cursor.fetchone()
            cursor.execute(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
                "WHERE indrelid = %s::regclass ORDER BY 1",
                [table],
            )
            indexes = dict(cursor.fetchall())
        else:
            cursor.execute(f"ANALYZE TABLE {table} PERSISTENT FOR ALL")
            cursor.fetchall()
            cursor.execute(
                "SELECT index_name, stat_value * @@innodb_page_size "
                "FROM mysql.innodb_index_stats WHERE database_name = DATABASE() "
                "AND table_name = %s AND stat_name = 'size' ORDER BY 1",
                [table],
            )
            pages = {name: int(size) for name, size in cursor.fetchall()}
            heap = pages.pop("PRIMARY")
            cursor.execute(f"SELECT COUNT(*) FROM {table}")
            rows = cursor.fetchone()[0]
            indexes = pages
    return {"rows": int(rows), "heap": int(heap), "indexes": indexes}


def row_bytes_by_state(connection: Any) -> dict[str, float]:
    """The average bytes of a key row by its state, from a sample of the table."""
    vendor = vendor_of(connection)
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(
                f"SELECT state, avg(pg_column_size(t.*)) FROM {KEYS} t "
                "TABLESAMPLE SYSTEM (1) GROUP BY state"
            )
        else:
            lengths = " + ".join(
                f"coalesce(length({quote(vendor, column)}), 0)" for column in KEY_COLUMNS
            )
            cursor.execute(
                f"SELECT state, avg({lengths} + 40) FROM "
                f"(SELECT * FROM {KEYS} ORDER BY id LIMIT 200000) t GROUP BY state"
            )
        return {state: float(size) for state, size in cursor.fetchall()}
