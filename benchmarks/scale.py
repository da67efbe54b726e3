"""What a request costs as the tables grow, and while they are purged.

The example app under gunicorn, driven by wrk at 8 connections, as ``benchmarks/run.py`` runs it:
at each size of the key table (0, 1, 10 and 30 million rows; MariaDB up to 10 million), bare,
fresh and replay POSTs, alternated round by round; at each size of the inbox (0 and 10 million
events), the bare webhook view and the inbox's ingest (its worker paused), every event delivered
twice. Then a million dispatched outbox messages, for their size. The tables are filled with
realistic rows by the database's bulk path (filling.py); what the fill took, and what a million
rows cost on disk, are reported.

On PostgreSQL, at the purge's size (10 million keys, a tenth expired), fresh POSTs alone and
while the purge runs: ``idempotency_purge`` and the Celery task ``purge_expired_keys`` with their
defaults, and the command with ten times the default batch, each right after a checkpoint (the
worst case for the WAL it writes). A watcher reports the purge's longest DELETE transaction (the
locks it held) and its longest read; the server's WAL and checkpoint counters around each purge,
and the dead tuples and the table's size after it, as autovacuum left them a minute later, are
reported too.

Prints Markdown tables; ``--plot PATH`` draws throughput and p99 against the table's size.
Usage: python -m benchmarks.scale [--database postgresql|mariadb] [--quick] [--plot PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import filling, run
from benchmarks.common import ROOT
from benchmarks.databases import DATABASES, scalar

if TYPE_CHECKING:
    from collections.abc import Iterator

MILLION = 1_000_000
KEY_SCENARIOS = ("bare", "fresh", "replay")
INBOX_SCENARIOS = ("bare-webhook", "inbox-database")
MANAGE = str(ROOT / "example_project" / "manage.py")
PURGES = {
    "idempotency_purge": [MANAGE, "idempotency_purge"],
    "idempotency_purge --batch-size 10000": [MANAGE, "idempotency_purge", "--batch-size", "10000"],
    "the Celery task": [
        "-c",
        "import django; django.setup(); "
        "from django_idempotency.tasks import purge_expired_keys; "
        "print(purge_expired_keys.apply().get())",
    ],
}


@dataclasses.dataclass
class Results:
    database: str
    # By size in millions: the fill's seconds, then each scenario's measures.
    keys: dict[float, dict[str, list[run.Measure]]] = dataclasses.field(default_factory=dict)
    inbox: dict[float, dict[str, list[run.Measure]]] = dataclasses.field(default_factory=dict)
    fills: dict[str, float] = dataclasses.field(default_factory=dict)
    disk: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    row_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    purges: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # PostgreSQL, by size: how often autovacuum vacuumed and analyzed the key table meanwhile.
    upkeep: dict[float, tuple[int, int]] = dataclasses.field(default_factory=dict)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", choices=list(DATABASES), default="postgresql")
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        help="key table sizes in millions (0 1 10 30, MariaDB 0 1 10)",
    )
    parser.add_argument("--inbox-sizes", type=float, nargs="+", default=[0, 10])
    parser.add_argument(
        "--purge-size", type=float, default=10, help="purge beside traffic at this size (0: not)"
    )
    parser.add_argument(
        "--outbox-size", type=float, default=1, help="dispatched messages to size, millions"
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per scenario and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--quick", action="store_true", help="1 million rows at most, 3 s rounds: a smoke run"
    )
    parser.add_argument("--plot", type=Path, help="draw throughput and p99 into this PNG")
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = [0, 1, 10] + ([30] if args.database == "postgresql" else [])
    if args.quick:
        args.sizes = [size for size in args.sizes if size <= 1]
        args.inbox_sizes = [0, 1]
        args.purge_size = min(args.purge_size, 1)
        args.outbox_size = min(args.outbox_size, 0.1)
        args.duration, args.rounds = 3, 1
    return args


def measure(args: argparse.Namespace) -> Results:
    server_args = run.parse_arguments(
        ["--database", args.database, "--duration", str(args.duration), "--port", str(args.port)]
    )
    results = Results(args.database)
    database = DATABASES[args.database]
    with run.serve(server_args) as server, database.connect(run.DATABASE) as connection:
        template = filling.key_template(connection, run.SCENARIOS["replay"]["key"])

        def keys(count: int) -> Iterator[filling.Row]:
            return filling.key_rows(template, count)

        for size in sorted(args.sizes):
            top_up(connection, results, filling.KEYS, size, keys)
            postgresql = args.database == "postgresql"
            before = autovacuum_runs(connection) if postgresql else (0, 0)
            results.keys[size] = alternate(server, server_args, KEY_SCENARIOS, args.rounds)
            if postgresql:
                after = autovacuum_runs(connection)
                results.upkeep[size] = (after[0] - before[0], after[1] - before[1])
            if args.purge_size and size == args.purge_size and postgresql:
                wait = 5 if args.quick else 65
                results.purges = purge_beside_traffic(server, server_args, template, wait)
                top_up(connection, results, filling.KEYS, size, keys)
        results.disk[filling.KEYS] = filling.sizes(connection, filling.KEYS)
        results.row_bytes = filling.row_bytes_by_state(connection)
        for size in sorted(args.inbox_sizes):
            top_up(connection, results, filling.INBOX, size, filling.inbox_rows)
            results.inbox[size] = alternate(server, server_args, INBOX_SCENARIOS, args.rounds)
        results.disk[filling.INBOX] = filling.sizes(connection, filling.INBOX)
        top_up(connection, results, filling.OUTBOX, args.outbox_size, filling.outbox_rows)
        results.disk[filling.OUTBOX] = filling.sizes(connection, filling.OUTBOX)
    return results


def top_up(connection: Any, results: Results, table: str, size: float, rows: Any) -> None:
    """Fill ``table`` up to ``size`` million rows; record how long it took."""
    missing = int(size * MILLION) - scalar(connection, f"SELECT count(*) FROM {table}")
    if missing > MILLION // 100:
        columns = {
            filling.KEYS: filling.KEY_COLUMNS,
            filling.INBOX: filling.INBOX_COLUMNS,
            filling.OUTBOX: filling.OUTBOX_COLUMNS,
        }[table]
        seconds = filling.fill(connection, table, columns, rows(missing))
        results.fills[f"{table} +{missing:,}"] = seconds
        print(f"filled {table} with {missing:,} rows in {seconds:.0f} s", file=sys.stderr)


def alternate(
    server: run.Server, args: argparse.Namespace, scenarios: tuple[str, ...], rounds: int
) -> dict[str, list[run.Measure]]:
    """Each scenario once a round, each round starting one later; round 0 warms up."""
    measured: dict[str, list[run.Measure]] = {scenario: [] for scenario in scenarios}
    for round_no in range(rounds + 1):
        shift = round_no % len(scenarios)
        for scenario in scenarios[shift:] + scenarios[:shift]:
            result = run.checked_run(server, scenario, args, round_no)
            if round_no:
                measured[scenario].append(result)
    return measured


def purge_beside_traffic(
    server: run.Server, args: argparse.Namespace, template: dict[str, Any], wait: float
) -> list[dict[str, Any]]:
    """Fresh POSTs alone, then while each purge runs; before each purge, a tenth of the table
    has expired. The table's state is read ``wait`` seconds after each."""
    report = []
    with DATABASES["postgresql"].connect(run.DATABASE) as connection:
        target = scalar(connection, f"SELECT count(*) FROM {filling.KEYS}") // 10
        for name, command in PURGES.items():
            expired = expired_keys(connection)
            if expired < target:
                rows = filling.key_rows(template, target - expired, expired=1.0)
                filling.fill(connection, filling.KEYS, filling.KEY_COLUMNS, rows)
                expired = expired_keys(connection)
            alone = run.run_wrk(server, "fresh", args, 400)
            # Each purge starts right after a checkpoint, the worst case: the first change to a
            # page after one writes the whole page to the WAL.
            with connection.cursor() as cursor:
                cursor.execute("CHECKPOINT")
            before = wal_and_checkpoints(connection)
            during, watcher = beside_purge(server, args, name, command)
            after = wal_and_checkpoints(connection)
            report.append(
                {
                    "purge": name,
                    "alone": alone,
                    "during": during,
                    "deleted": expired - expired_keys(connection),
                    "seconds": watcher.last - watcher.first,
                    "longest": watcher.longest,
                    "written": {name: after[name] - before[name] for name in after},
                    **table_state(connection, wait),
                }
            )
    return report


def beside_purge(
    server: run.Server, args: argparse.Namespace, name: str, command: list[str]
) -> tuple[run.Measure, LongestTransaction]:
    """Fresh POSTs while ``command`` purges, and what the watcher saw of the purge."""
    watcher = LongestTransaction()
    watcher.start()
    env = {**server.env, "PGAPPNAME": "purge"}
    purge = subprocess.Popen(
        [sys.executable, *command], env=env, cwd=ROOT, stdout=subprocess.DEVNULL
    )
    # The load starts with the purge's first transaction (not with Django's start-up) and stops
    # when it ends: every request it counts ran beside the purge.
    while not watcher.first and purge.poll() is None:
        time.sleep(0.01)
    script = run.payment_script(run.SCENARIOS["fresh"]["path"], "", f"purge-{time.time_ns()}")
    with run.wrk_command(server.base, script, args.threads, args.connections, 3600) as line:
        load = subprocess.Popen(line, stdout=subprocess.PIPE, text=True)
        loaded = time.monotonic()
        purge.wait(timeout=3600)
        time.sleep(max(0.0, loaded + 1 - time.monotonic()))  # wrk reports after a second
        load.send_signal(signal.SIGINT)
        output, _ = load.communicate(timeout=60)
    watcher.stop()
    if purge.returncode:
        raise SystemExit(f"{name} failed")
    return run.parse_wrk(output, f"fresh during {name}", args.connections), watcher


def expired_keys(connection: Any) -> int:
    sql = f"SELECT count(*) FROM {filling.KEYS} WHERE expires_at < now()"
    return int(scalar(connection, sql))


def autovacuum_runs(connection: Any) -> tuple[int, int]:
    """How often autovacuum has vacuumed and analyzed the key table, on PostgreSQL."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT autovacuum_count, autoanalyze_count FROM pg_stat_user_tables "
            "WHERE relname = %s",
            [filling.KEYS],
        )
        vacuums, analyzes = cursor.fetchone()
    return int(vacuums), int(analyzes)


def wal_and_checkpoints(connection: Any) -> dict[str, int]:
    """The server's counters of WAL written and of checkpoints, whose difference around a purge
    says what it made the server write (the traffic beside it included)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT wal_bytes, wal_fpi, checkpoints_timed + checkpoints_req, buffers_checkpoint, "
            "buffers_backend FROM pg_stat_wal, pg_stat_bgwriter"
        )
        values = cursor.fetchone()
    names = ("wal_bytes", "wal_fpi", "checkpoints", "buffers_checkpoint", "buffers_backend")
    return dict(zip(names, map(int, values), strict=True))


def table_state(connection: Any, wait: float) -> dict[str, Any]:
    """The dead tuples and the key table's size ``wait`` seconds after the purge (autovacuum
    wakes up once a minute), and whether autovacuum ran by then."""
    time.sleep(wait)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT n_dead_tup, n_live_tup, last_autovacuum IS NOT NULL "
            "AND last_autovacuum > now() - interval '70 seconds', "
            "pg_table_size(relid), pg_indexes_size(relid) "
            "FROM pg_stat_user_tables WHERE relname = %s",
            [filling.KEYS],
        )
        dead, live, vacuumed, heap, indexes = cursor.fetchone()
    return {"dead": dead, "live": live, "vacuumed": vacuumed, "heap": heap, "index": indexes}


class LongestTransaction(threading.Thread):
    """Watches, every 10 ms, the purge's open transaction: when the first and the last were
    seen (monotonic seconds), and, for its deletes and for its reads apart, how long the
    longest had been running and its statement.

    A read is the span's ``SELECT``, a statement of its own; every other statement belongs to a
    batch's transaction, its ``COMMIT`` included (the locks are held until the commit is done).
    """

    QUERY = (
        "SELECT extract(epoch FROM clock_timestamp() - xact_start), query "
        "FROM pg_stat_activity WHERE application_name = 'purge' AND xact_start IS NOT NULL"
    )

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.first = self.last = 0.0
        # By the kind of statement ("DELETE" or "read"): its seconds and its text.
        self.longest: dict[str, tuple[float, str]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        with (
            DATABASES["postgresql"].connect(run.DATABASE) as connection,
            connection.cursor() as cursor,
        ):
            while not self.done.wait(0.01):
                cursor.execute(self.QUERY)
                for age, statement in cursor.fetchall():
                    self.last = time.monotonic()
                    self.first = self.first or self.last
                    kind = "read" if statement.lstrip().upper().startswith("SELECT") else "DELETE"
                    if float(age) > self.longest.get(kind, (0.0, ""))[0]:
                        self.longest[kind] = (float(age), " ".join(statement.split()))

    def stop(self) -> None:
        self.done.set()
        self.join()


def median(measures: list[run.Measure], field: str) -> float:
    return statistics.median(measure[field] for measure in measures)


def main() -> None:
    args = parse_arguments()
    from benchmarks import scale_report  # noqa: PLC0415

    results = measure(args)
    print(scale_report.report(results, args))
    if args.plot:
        scale_report.plot(results, args, args.plot)
        print(f"\nThe plot is in {args.plot}.")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
