#!/usr/bin/env python
"""Measure what idempotency costs an async view: the example under uvicorn, driven by wrk.

Scenarios, alternated round by round as in run.py (each round starting one scenario later), so
that every ratio comes from one run:
  async-bare    POST to the example's async payment view without @idempotent, its writes in one
                transaction
  async-fresh   POST to the example's async payment view (/async/payments/), a new key each time
  async-replay  the same, always the same key (every answer a replay)
Every run checks its effects: one payment per bare or fresh request and one key per fresh one,
none per replay. uvicorn runs --workers worker processes (2) with the example's ASGI application
on PostgreSQL (or MariaDB), with CONN_MAX_AGE = 0 as Django advises under ASGI: every request
opens its database connection, in each scenario alike.

Prints a Markdown table. Needs wrk, uvicorn, a database server and Redis as run.py does.
Usage: python benchmarks/asgi_requests.py [--duration S] [--rounds N] [--workers N] ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, plural
from benchmarks.databases import DATABASES, scalar
from benchmarks.run import (
    environment,
    payment_script,
    prepare_database,
    seed_key,
    wait_until_up,
    wrk,
)
from benchmarks.tables import scenario_table

if TYPE_CHECKING:
    from collections.abc import Iterator

    from benchmarks.run import Measure, Runs

DATABASE = "idempotency_bench_asgi"
SCENARIOS = {
    "async-bare": {"path": "/bench/bare/async/payments/", "key": "none"},
    "async-fresh": {"path": "/async/payments/", "key": ""},
    "async-replay": {"path": "/async/payments/", "key": "the-one-key"},
}
# Rows each scenario must write per request: proof that the load was what it says it is.
COUNTS = {
    "async-bare": {"payments_payment": 1, "django_idempotency_idempotencykey": 0},
    "async-fresh": {"payments_payment": 1, "django_idempotency_idempotencykey": 1},
    "async-replay": {"payments_payment": 0, "django_idempotency_idempotencykey": 0},
}


@dataclasses.dataclass
class Results:
    """Every round's figures by scenario, and how uvicorn ran."""

    rounds: Runs
    server: str


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--database", choices=list(DATABASES), default="postgresql", help="the server to run on"
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per scenario and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument("--port", type=int, default=8770)
    return parser.parse_args(argv)


@contextlib.contextmanager
def serve(args: argparse.Namespace) -> Iterator[str]:
    """A new database and uvicorn serving the example on it; its address. Both gone afterwards."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    env = {
        **environment(args.port, args.database),
        "BENCH_ASGI": "1",
        # The example's own knob, as benchmarks/urls.py sets it for the other views.
        "EXAMPLE_PROVIDER_LATENCY": "0",
    }
    # A database of its own, as each part has.
    env["DATABASE_URL"] = DATABASES[args.database].url(DATABASE)
    try:
        prepare_database(env, args.database, DATABASE)
        command = [
            sys.executable, "-m", "uvicorn", "benchmarks.asgi:application",
            "--host", "127.0.0.1", "--port", str(args.port), "--workers", str(args.workers),
            "--lifespan", "off", "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
        process = subprocess.Popen(command, env=env, cwd=ROOT)
        try:
            base = f"http://127.0.0.1:{args.port}"
            wait_until_up(base + "/api/payments/")
            seed_key(base, SCENARIOS["async-replay"]["path"], SCENARIOS["async-replay"]["key"])
            yield base
        finally:
            process.terminate()
            process.wait(timeout=60)
    finally:
        DATABASES[args.database].drop(DATABASE)


def rows(database: str) -> dict[str, int]:
    """The rows of every table the scenarios write to, once the requests that wrk left in flight
    have written theirs."""
    tables = sorted({table for counts in COUNTS.values() for table in counts})

    def count() -> dict[str, int]:
        with DATABASES[database].connect(DATABASE) as connection:
            return {table: scalar(connection, f"SELECT count(*) FROM {table}") for table in tables}

    counted = count()
    while True:
        time.sleep(0.1)
        again = count()
        if again == counted:
            return counted
        counted = again


def checked_run(base: str, scenario: str, args: argparse.Namespace, round_no: int) -> Measure:
    """One wrk run of ``scenario``, failing unless it wrote the rows of ``COUNTS`` per request."""
    before = rows(args.database)
    spec = SCENARIOS[scenario]
    measured = wrk(
        base,
        payment_script(spec["path"], spec["key"], f"asgi{round_no}-{time.time_ns()}"),
        scenario,
        threads=min(args.threads, args.connections),
        connections=args.connections,
        duration=args.duration,
    )
    after = rows(args.database)
    for table, share in COUNTS[scenario].items():
        expected = measured["requests"] * share
        written = after[table] - before[table]
        # Requests still in flight when wrk stops are written but not counted.
        slack = args.connections if share else 0
        if not expected <= written <= expected + slack:
            raise SystemExit(f"{scenario}: {written} rows of {table} for {expected:.0f} requests")
    return measured


def measure(args: argparse.Namespace) -> Results:
    """Serve the example under uvicorn and run the scenarios, alternated round by round."""
    rounds: Runs = {name: [] for name in SCENARIOS}
    names = list(SCENARIOS)
    with serve(args) as base:
        for round_no in range(args.rounds + 1):  # round 0 warms up and is not counted
            for scenario in names[round_no % len(names) :] + names[: round_no % len(names)]:
                measured = checked_run(base, scenario, args, round_no)
                if round_no:
                    rounds[scenario].append(measured)
    server = f"uvicorn {metadata.version('uvicorn')}, {plural(args.workers, 'worker')}"
    return Results(rounds, server)


def report(results: Results, args: argparse.Namespace) -> str:
    return (
        f"{plural(args.rounds, 'round')} x {args.duration} s after a warm-up round, "
        f"{args.connections} connections, {results.server}; medians of the rounds. Every round "
        "checked that `async-bare` and `async-fresh` stored one payment per request, "
        "`async-fresh` one key per request, and `async-replay` none.\n\n"
        + scenario_table(results.rounds, tuple(SCENARIOS))
    )


def main() -> None:
    args = parse_arguments()
    print(report(measure(args), args))


if __name__ == "__main__":
    main()
