#!/usr/bin/env python
"""Where a keyed request's time goes: the benchmark's views in this process, on PostgreSQL.

Serves the benchmark's URLs (benchmarks/settings.py: the example app, persistent connections,
logging at WARNING) through Django's WSGI handler in this process, without a server or a
network, to one PostgreSQL database of its own. For each scenario of run.py's requests (bare,
fresh, replay, naive-fresh, naive-replay) it prints:
  - the wall time of a request, median of --rounds rounds of --requests requests, alternated;
  - the statements Django sends and the round trips to the server (libpq's own trace: each
    simple query and each Sync of the extended protocol, BEGIN and COMMIT included), and the
    median time of each statement from Django's cursor, and the server's planning time of it
    (EXPLAIN SUMMARY, which runs nothing);
then profiles --requests requests of each but bare with cProfile and prints the time
spent in each part of the library, per request (cProfile slows Python code down, calls most;
read the shares, not the milliseconds). --stats DIR keeps the profiles for pstats or snakeviz.

Needs a PostgreSQL server (PGHOST/PGPORT/PGUSER, default 127.0.0.1:5432/postgres).
Usage: python benchmarks/profiling.py [--requests N] [--rounds N] [--stats DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, drop_database, millis, recreate_database, table
from benchmarks.databases import DATABASES
from benchmarks.run import AUTH, BODY, SCENARIOS

DATABASE = "idempotency_bench_profile"
PROFILED = ("fresh", "replay", "naive-fresh", "naive-replay")

# The parts of a request, each the cumulative time of one function: (file's end, function).
PARTS = {
    "the whole request (Django's WSGI handler)": ("django/core/handlers/wsgi.py", "__call__"),
    "authentication (HTTP Basic: a query, a password hash)": (
        "rest_framework/request.py",
        "_authenticate",
    ),
    "the idempotency engine, all of it": ("django_idempotency/engine.py", "handle"),
    "… the view it runs (serializer, payment, ledger entry)": (
        "django_idempotency/engine.py",
        "__call__",
    ),
    "… building the policy (get_idempotency_policy)": (
        "django_idempotency/drf.py",
        "get_idempotency_policy",
    ),
    "… canonical JSON and SHA-256 (request_fingerprint)": (
        "django_idempotency/fingerprint.py",
        "request_fingerprint",
    ),
    "… the claim (KeyStore.acquire: its statement)": ("django_idempotency/store.py", "acquire"),
    "… the completion (capture and UPDATE)": ("django_idempotency/engine.py", "_complete"),
    "… … capturing the response's headers and bytes": (
        "django_idempotency/responses.py",
        "capture",
    ),
    "… the replay's response (replay_response)": (
        "django_idempotency/responses.py",
        "replay_response",
    ),
    "… signals and their receivers (metrics, tracing)": (
        "django_idempotency/signals.py",
        "send_robustly",
    ),
    "… structured logging (only at INFO)": ("django_idempotency/outcomes.py", "_log"),
    "the naive view's post()": ("benchmarks/naive.py", "post"),
    "every SQL statement (Django's cursor)": ("django/db/backends/utils.py", "_execute"),
    "commits": ("django/db/backends/base/base.py", "commit"),
}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per scenario")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per scenario")
    parser.add_argument("--stats", type=Path, help="keep each scenario's profile in this folder")
    return parser.parse_args(argv)


def setup() -> Any:
    """Django on the benchmark's settings and a new database; the WSGI handler."""
    sys.path[:0] = [str(ROOT), str(ROOT / "example_project")]
    os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.settings"
    os.environ["DATABASE_URL"] = DATABASES["postgresql"].url(DATABASE)
    recreate_database(DATABASE)
    import django  # noqa: PLC0415 - set up only once the database exists

    django.setup()
    from django.contrib.auth.models import User  # noqa: PLC0415
    from django.core.handlers.wsgi import WSGIHandler  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415
    from django.db import connection  # noqa: PLC0415

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(DATABASES["postgresql"].naive_table)
    User.objects.create_user("alice", password="password")  # noqa: S106 - a benchmark's user
    return WSGIHandler()


class Client:
    """POSTs the benchmark's payment to the WSGI handler as gunicorn would."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.counter = 0

    def post(self, scenario: str) -> None:
        spec = SCENARIOS[scenario]
        self.counter += 1
        body = BODY.encode()
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": spec["path"],
            "SCRIPT_NAME": "",
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8765",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "HTTP_HOST": "127.0.0.1:8765",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_AUTHORIZATION": AUTH,
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http",
            "wsgi.version": (1, 0),
            "wsgi.multithread": False,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        if spec["key"] != "none":
            environ["HTTP_IDEMPOTENCY_KEY"] = spec["key"] or f"profile-{self.counter}"
        statuses: list[str] = []
        response = self.handler(environ, lambda status, *_: statuses.append(status))
        b"".join(response)
        response.close()
        if not statuses[0].startswith("201"):
            raise SystemExit(f"{scenario}: {statuses[0]}")


def timings(client: Client, args: argparse.Namespace) -> dict[str, float]:
    """Median milliseconds per request of each scenario, rounds alternated."""
    runs: dict[str, list[float]] = {scenario: [] for scenario in ("bare", *PROFILED)}
    for _ in range(args.rounds):
        for scenario, seconds in runs.items():
            started = time.perf_counter()
            for _ in range(args.requests):
                client.post(scenario)
            seconds.append((time.perf_counter() - started) * 1000 / args.requests)
    return {scenario: statistics.median(seconds) for scenario, seconds in runs.items()}


def round_trips(client: Client, scenario: str) -> tuple[int, int]:
    """Statements Django sent and round trips to the server for one request of ``scenario``."""
    from django.db import connection  # noqa: PLC0415

    statements: list[str] = []

    def count(execute: Any, sql: str, *rest: Any) -> Any:
        statements.append(sql)
        return execute(sql, *rest)

    connection.ensure_connection()
    with tempfile.TemporaryFile("w+") as trace, connection.execute_wrapper(count):
        pgconn = connection.connection.pgconn
        pgconn.trace(trace.fileno())
        try:
            client.post(scenario)
        finally:
            pgconn.untrace()
        trace.seek(0)
        # Each frontend Query, and each Sync closing an extended-protocol exchange, is a trip.
        trips = sum(
            1 for line in trace if "\tF\t" in line and ("\tQuery\t" in line or "\tSync" in line)
        )
    return len(statements), trips


def statement_times(client: Client, scenario: str, requests: int) -> list[tuple[str, float, float]]:
    """Each statement of a ``scenario`` request, in order: its start, its median milliseconds
    from the client, and the median of the server's planning time alone (EXPLAIN SUMMARY)."""
    from django.db import connection  # noqa: PLC0415

    timed: list[tuple[str, Any, float]] = []

    def time_it(execute: Any, sql: str, params: Any, *rest: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, *rest)
        finally:
            timed.append((sql, params, (time.perf_counter() - started) * 1000))

    runs = []
    with connection.execute_wrapper(time_it):
        for _ in range(requests):
            timed.clear()
            client.post(scenario)
            runs.append(list(timed))
    statements = []
    for n, (sql, params, _) in enumerate(runs[0]):
        statements.append(
            (
                " ".join(sql.split()[:3]),
                statistics.median(run[n][2] for run in runs),
                planning(sql, params),
            )
        )
    return statements


def planning(sql: str, params: Any) -> float:
    """The server's median planning time of ``sql`` in milliseconds; EXPLAIN runs nothing."""
    from django.db import connection  # noqa: PLC0415

    times = []
    with connection.cursor() as cursor:
        for _ in range(50):
            cursor.execute(f"EXPLAIN (SUMMARY, FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
            times.append(plan[0]["Planning Time"])
    return statistics.median(times)


def statements_section(client: Client, requests: int) -> str:
    rows = []
    for scenario in PROFILED:
        statements = statement_times(client, scenario, requests)
        listed = "; ".join(f"`{sql} …` {ms:.2f} ({plan:.2f})" for sql, ms, plan in statements)
        total = sum(ms for _, ms, _ in statements)
        rows.append([f"`{scenario}`", listed, millis(total)])
    header = ["scenario", "statements in order: median ms each (of which planning)", "together"]
    return table(header, rows)


def profile(client: Client, scenario: str, args: argparse.Namespace) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.requests):
        client.post(scenario)
    profiler.disable()
    stats = pstats.Stats(profiler)
    if args.stats:
        args.stats.mkdir(parents=True, exist_ok=True)
        stats.dump_stats(args.stats / f"{scenario}.prof")
    return stats


def cumulative(stats: pstats.Stats, where: tuple[str, str]) -> tuple[float, int]:
    """Seconds spent in the function ``where`` (and what it calls), and its number of calls."""
    seconds, calls = 0.0, 0
    for (filename, _line, name), row in stats.stats.items():  # type: ignore[attr-defined]
        if name == where[1] and filename.endswith(where[0]):
            # (primitive calls, calls, own time, cumulative time, callers)
            seconds += row[3]
            calls += row[0]
    return seconds, calls


def breakdown(profiles: dict[str, pstats.Stats], requests: int) -> str:
    rows = []
    totals = {
        name: cumulative(stats, PARTS[next(iter(PARTS))])[0] for name, stats in profiles.items()
    }
    for part, where in PARTS.items():
        row = [part]
        for name, stats in profiles.items():
            seconds, calls = cumulative(stats, where)
            if not calls:
                row.append("none")
                continue
            per = f" ({calls / requests:g} calls)" if calls != requests else ""
            row.append(f"{millis(seconds * 1000 / requests)}, {seconds / totals[name]:.0%}{per}")
        rows.append(row)
    return table(["per request, under cProfile", *(f"`{name}`" for name in profiles)], rows)


def main() -> None:
    args = parse_arguments()
    try:
        client = Client(setup())
        for scenario in ("replay", "naive-replay"):
            client.post(scenario)  # store the one key that every later request replays
        for scenario in ("bare", *PROFILED):  # warm up: imports, connections, caches
            for _ in range(50):
                client.post(scenario)
        measured = timings(client, args)
        trips = {scenario: round_trips(client, scenario) for scenario in measured}
        rows = [
            [
                f"`{scenario}`",
                millis(ms),
                f"{ms / measured['bare']:.2f}",
                str(trips[scenario][0]),
                str(trips[scenario][1]),
            ]
            for scenario, ms in measured.items()
        ]
        print(
            f"In this process, no server: median of {args.rounds} rounds x {args.requests} "
            "requests.\n\n"
            + table(["scenario", "per request", "vs bare", "statements", "round trips"], rows)
        )
        print("\n" + statements_section(client, args.requests))
        profiles = {scenario: profile(client, scenario, args) for scenario in PROFILED}
        print("\n" + breakdown(profiles, args.requests))
    finally:
        from django.db import connections  # noqa: PLC0415

        connections.close_all()
        drop_database(DATABASE)


if __name__ == "__main__":
    main()
