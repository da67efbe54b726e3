#!/usr/bin/env python
"""Where a keyed request's time goes: the benchmark's views in this process, on PostgreSQL.

Serves the benchmark's URLs (benchmarks/settings.py: the example app, persistent connections,
logging at WARNING; with --minimal, the minimal project of benchmarks/minimal instead) through
Django's WSGI handler in this process, without a server or a network, to one PostgreSQL
database of its own. For run.py's requests (bare, fresh, replay,
naive-fresh, naive-replay, cached-fresh, cached-replay, naive-cached-replay) and its webhooks
(bare-webhook, naive-webhook, and inbox-database: the inbox's "database" runner, whose request
only records the event; each event is delivered twice, new then a duplicate, and timed as one
sample) it prints:
  - the wall time of a request, median of --requests samples of each scenario, the scenarios
    alternated sample by sample, so that a machine that slows down slows them all alike;
  - the statements Django sends and the round trips to the server (libpq's own trace: each
    simple query and each Sync of the extended protocol, BEGIN and COMMIT included), and the
    median time of each statement from Django's cursor, and the server's planning time of it
    (EXPLAIN SUMMARY, which runs nothing);
then profiles --requests requests of each but the bare ones with cProfile and prints the time
spent in each part of the library, per request (cProfile slows Python code down, calls most;
read the shares, not the milliseconds). --stats DIR keeps the profiles for pstats or snakeviz.

Needs a PostgreSQL server (PGHOST/PGPORT/PGUSER, default 127.0.0.1:5432/postgres) and Redis on
127.0.0.1:6379 (the cached-* scenarios' replay cache).
Usage: python benchmarks/profiling.py [--minimal] [--requests N] [--stats DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
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
from benchmarks.run import AUTH, BODY, SCENARIOS, signer

# Each shape: its settings, its scenarios (run.py's names), and its replay cache's alias.
SHAPES = {
    "example": {"settings": "benchmarks.settings", "cache": "bench-replay"},
    "minimal": {"settings": "benchmarks.minimal.settings", "cache": "replay"},
}

DATABASE = "idempotency_bench_profile"
PROFILED = ("fresh", "replay", "naive-fresh", "naive-replay", "cached-fresh", "cached-replay")
REQUESTS = ("bare", *PROFILED, "naive-cached-replay")
WEBHOOKS = ("bare-webhook", "naive-webhook", "inbox-database")

# The parts of a request, each the cumulative time of one function: (file's end, function).
PARTS = {
    "the whole request (Django's WSGI handler)": ("django/core/handlers/wsgi.py", "__call__"),
    "authentication (HTTP Basic: a query, a password hash)": (
        "rest_framework/request.py",
        "_authenticate",
    ),
    "the idempotency engine, all of it": ("django_idempotency/core/keyed_request.py", "handle"),
    "… the view it runs": (
        "django_idempotency/core/keyed_request.py",
        "__call__",
    ),
    "… building the policy (get_idempotency_policy)": (
        "django_idempotency/drf.py",
        "get_idempotency_policy",
    ),
    "… canonical JSON and SHA-256 (request_fingerprint)": (
        "django_idempotency/core/fingerprint.py",
        "request_fingerprint",
    ),
    "… the read of the key's row before a transaction (KeyStore.lookup; not on PostgreSQL)": (
        "django_idempotency/core/store.py",
        "lookup",
    ),
    "… holding the key (KeyStore.reserve: PostgreSQL's lock and read, or a claim)": (
        "django_idempotency/core/store.py",
        "reserve",
    ),
    "… the completion (capture; PostgreSQL's INSERT of the row, or an UPDATE)": (
        "django_idempotency/core/engine.py",
        "_complete",
    ),
    "… … capturing the response's headers and bytes": (
        "django_idempotency/core/responses.py",
        "capture",
    ),
    "… the replay cache's read (ReplayCache.get)": ("django_idempotency/core/cache.py", "get"),
    "… the replay's response (replay_response)": (
        "django_idempotency/core/responses.py",
        "replay_response",
    ),
    "… signals and their receivers (metrics, tracing)": (
        "django_idempotency/signals.py",
        "send_robustly",
    ),
    "… structured logging (only at INFO)": ("django_idempotency/core/outcomes.py", "_log"),
    "the naive layer, with the view it runs": ("benchmarks/naive.py", "naive_idempotent"),
    "every SQL statement (Django's cursor)": ("django/db/backends/utils.py", "_execute"),
    "commits": ("django/db/backends/base/base.py", "commit"),
}
# The parts of a webhook's delivery to the inbox.
INBOX_PARTS = {
    "the whole request (Django's WSGI handler)": ("django/core/handlers/wsgi.py", "__call__"),
    "the receiver view's post()": ("django_idempotency/inbox/views.py", "post"),
    "… verifying the signature and parsing the payload": (
        "django_idempotency/inbox/views.py",
        "_read",
    ),
    "… … the signature alone (HMAC-SHA256)": ("django_idempotency/signing.py", "verify"),
    "… recording the event once (receive)": ("django_idempotency/inbox/receiving.py", "receive"),
    "… … canonical JSON and SHA-256 of the payload": (
        "django_idempotency/inbox/receiving.py",
        "payload_hash",
    ),
    "… … its statements, with the values they send": (
        "django_idempotency/inbox/statements.py",
        "record",
    ),
    "… … a duplicate's count, kept in memory": (
        "django_idempotency/inbox/receiving.py",
        "_duplicate",
    ),
    "… … signals and their receivers": ("django_idempotency/signals.py", "send_robustly"),
    "every SQL statement (Django's cursor)": ("django/db/backends/utils.py", "_execute"),
}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per scenario")
    parser.add_argument("--stats", type=Path, help="keep each scenario's profile in this folder")
    parser.add_argument(
        "--minimal", action="store_true", help="the minimal project (benchmarks/minimal)"
    )
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    return args


def setup(shape: str) -> Any:
    """Django on the shape's settings and a new database; the WSGI handler."""
    sys.path[:0] = [str(ROOT), str(ROOT / "example_project")]
    os.environ["DJANGO_SETTINGS_MODULE"] = SHAPES[shape]["settings"]
    os.environ["DATABASE_URL"] = DATABASES["postgresql"].url(DATABASE)
    # The inbox's "database" runner: a delivery records its event, and no worker runs here.
    os.environ["BENCH_INBOX_RUNNER"] = "database"
    recreate_database(DATABASE)
    import django  # noqa: PLC0415 - set up only once the database exists

    django.setup()
    from django.contrib.auth.models import User  # noqa: PLC0415
    from django.core.handlers.wsgi import WSGIHandler  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415
    from django.db import connection  # noqa: PLC0415

    call_command("migrate", verbosity=0, run_syncdb=True)
    from django.core.cache import caches  # noqa: PLC0415

    caches[SHAPES[shape]["cache"]].clear()  # the cached-* scenarios' replay cache (Redis)
    with connection.cursor() as cursor:
        cursor.execute(DATABASES["postgresql"].naive_table)
        cursor.execute(DATABASES["postgresql"].bare_table)
        cursor.execute(DATABASES["postgresql"].naive_event_table)
    User.objects.create_user("alice", password="password")  # noqa: S106 - a benchmark's user
    return WSGIHandler()


class Client:
    """POSTs the benchmark's payment, or a signed webhook, to the WSGI handler as gunicorn would."""

    def __init__(self, handler: Any, shape: str) -> None:
        self.handler = handler
        self.scenarios = SCENARIOS
        self.sign = lambda body: signer().sign(body)
        if shape == "minimal":
            from django.conf import settings  # noqa: PLC0415

            from benchmarks.minimal.bench import SCENARIOS as MINIMAL  # noqa: PLC0415
            from django_idempotency.signing import StripeSignature  # noqa: PLC0415

            self.scenarios = MINIMAL
            self.sign = StripeSignature([settings.WEBHOOK_SECRET]).sign
        self.counter = 0
        self.deliveries: dict[str, int] = {}

    def post(self, scenario: str) -> float:
        """Send one request of ``scenario``; return the seconds the handler took to answer."""
        if scenario in WEBHOOKS:
            body, headers, expected = self._webhook(scenario)
        else:
            body, headers, expected = self._payment(scenario)
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": self.scenarios[scenario]["path"],
            "SCRIPT_NAME": "",
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8765",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "HTTP_HOST": "127.0.0.1:8765",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(body)),
            **headers,
            "wsgi.input": io.BytesIO(body),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http",
            "wsgi.version": (1, 0),
            "wsgi.multithread": False,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        statuses: list[str] = []
        started = time.perf_counter()
        response = self.handler(environ, lambda status, *_: statuses.append(status))
        b"".join(response)
        response.close()
        seconds = time.perf_counter() - started
        if not statuses[0].startswith(expected):
            raise SystemExit(f"{scenario}: {statuses[0]}")
        return seconds

    def _payment(self, scenario: str) -> tuple[bytes, dict[str, str], str]:
        self.counter += 1
        headers = {"HTTP_AUTHORIZATION": AUTH}
        key = self.scenarios[scenario]["key"]
        if key != "none":
            headers["HTTP_IDEMPOTENCY_KEY"] = key or f"profile-{self.counter}"
        return BODY.encode(), headers, "201"

    def sample(self, scenario: str) -> float:
        """One sample of ``scenario``: a request; for a webhook, an event delivered twice, new
        then a duplicate, as run.py sends them. Return the seconds per request."""
        return sum(self.post(scenario) for _ in range(per_sample(scenario))) / per_sample(scenario)

    def _webhook(self, scenario: str) -> tuple[bytes, dict[str, str], str]:
        sent = self.deliveries[scenario] = self.deliveries.get(scenario, 0) + 1
        number = (sent - 1) // 2  # each event twice in a row
        event = {"id": f"evt_profile_{number}", "type": "refund.succeeded"}
        body = json.dumps({**event, "data": {"refund": number, "sequence": 1}}).encode()
        signature = self.sign(body)["Stripe-Signature"]
        return body, {"HTTP_STRIPE_SIGNATURE": signature}, "200"


def per_sample(scenario: str) -> int:
    """Requests in one sample of ``scenario``: two for a webhook (new, then a duplicate)."""
    return 2 if scenario in WEBHOOKS else 1


def timings(client: Client, scenarios: tuple[str, ...], requests: int) -> dict[str, float]:
    """Median milliseconds per request of each scenario, alternated sample by sample."""
    seconds: dict[str, list[float]] = {scenario: [] for scenario in scenarios}
    for _ in range(requests):
        for scenario, taken in seconds.items():
            taken.append(client.sample(scenario))
    return {scenario: statistics.median(taken) * 1000 for scenario, taken in seconds.items()}


def round_trips(client: Client, scenario: str) -> tuple[float, float]:
    """Statements Django sent and round trips to the server per request of ``scenario``."""
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
            client.sample(scenario)
        finally:
            pgconn.untrace()
        trace.seek(0)
        # Each frontend Query, and each Sync closing an extended-protocol exchange, is a trip.
        trips = sum(
            1 for line in trace if "\tF\t" in line and ("\tQuery\t" in line or "\tSync" in line)
        )
    return len(statements) / per_sample(scenario), trips / per_sample(scenario)


def statement_times(
    client: Client, scenarios: tuple[str, ...], requests: int
) -> dict[str, list[tuple[str, float, float]]]:
    """Each statement of a sample of each scenario, in order: its start, its median
    milliseconds from the client, and the median of the server's planning time alone (EXPLAIN
    SUMMARY). The scenarios are alternated sample by sample; a webhook's sample is its event's
    recording, then the duplicate's."""
    from django.db import connection  # noqa: PLC0415

    timed: list[tuple[str, Any, float]] = []

    def time_it(execute: Any, sql: str, params: Any, *rest: Any) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, *rest)
        finally:
            timed.append((sql, params, (time.perf_counter() - started) * 1000))

    runs: dict[str, list[list[tuple[str, Any, float]]]] = {scenario: [] for scenario in scenarios}
    with connection.execute_wrapper(time_it):
        for _ in range(requests):
            for scenario, done in runs.items():
                timed.clear()
                client.sample(scenario)
                done.append(list(timed))
    for scenario, done in runs.items():
        if any([sql for sql, *_ in run] != [sql for sql, *_ in done[0]] for run in done):
            raise SystemExit(f"{scenario}: its requests did not all send the same statements")
    return {
        scenario: [
            (
                " ".join(sql.split()[:3]),
                statistics.median(run[n][2] for run in done),
                planning(sql, params),
            )
            for n, (sql, params, _) in enumerate(done[0])
        ]
        for scenario, done in runs.items()
    }


def planning(sql: str, params: Any) -> float:
    """The server's median planning time of ``sql`` in milliseconds; EXPLAIN runs nothing."""
    from django.db import connection  # noqa: PLC0415

    times: list[float] = []
    with connection.cursor() as cursor:
        for _ in range(50):
            cursor.execute(f"EXPLAIN (SUMMARY, FORMAT JSON) {sql}", params)
            plan = cursor.fetchone()[0]
            times.append(plan[0]["Planning Time"])
    return statistics.median(times)


def statements_section(client: Client, scenarios: tuple[str, ...], requests: int) -> str:
    rows = []
    for scenario, statements in statement_times(client, scenarios, requests).items():
        listed = "; ".join(f"`{sql} …` {ms:.2f} ({plan:.2f})" for sql, ms, plan in statements)
        total = sum(ms for _, ms, _ in statements) / per_sample(scenario)
        rows.append([f"`{scenario}`", listed, f"{total:.2f} ms"])
    header = [
        "scenario",
        "statements in order: median ms each (of which planning)",
        "together, per request",
    ]
    return table(header, rows)


def profile(client: Client, scenario: str, args: argparse.Namespace) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.requests):
        client.sample(scenario)
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


def breakdown(
    profiles: dict[str, pstats.Stats], parts: dict[str, tuple[str, str]], requests: int
) -> str:
    rows = []
    whole = next(iter(parts.values()))
    totals = {name: cumulative(stats, whole)[0] for name, stats in profiles.items()}
    for part, where in parts.items():
        row = [part]
        for name, stats in profiles.items():
            seconds, calls = cumulative(stats, where)
            if not calls:
                row.append("none")
                continue
            done = requests * per_sample(name)
            per = f" ({calls / done:g} calls)" if calls != done else ""
            row.append(f"{millis(seconds * 1000 / done)}, {seconds / totals[name]:.0%}{per}")
        rows.append(row)
    return table(["per request, under cProfile", *(f"`{name}`" for name in profiles)], rows)


def costs(client: Client, scenarios: tuple[str, ...], requests: int) -> str:
    """Each scenario's time per request against the first's, its statements and round trips."""
    measured = timings(client, scenarios, requests)
    base = measured[scenarios[0]]
    rows = []
    for scenario, ms in measured.items():
        statements, trips = round_trips(client, scenario)
        rows.append(
            [f"`{scenario}`", f"{ms:.2f} ms", f"{ms / base:.2f}", f"{statements:g}", f"{trips:g}"]
        )
    header = ["scenario", "per request", f"time vs {scenarios[0]}", "statements", "round trips"]
    return table(header, rows)


def measure(args: argparse.Namespace) -> str:
    """Every table of this script, in Markdown; the database is gone afterwards."""
    try:
        shape = "minimal" if args.minimal else "example"
        client = Client(setup(shape), shape)
        for scenario in (
            *("replay", "naive-replay"),
            *("cached-replay", "cached-replay"),
            *("naive-cached-replay", "naive-cached-replay"),
        ):
            # Store the one key that every later request replays; a cached scenario's second
            # request fills its cache.
            client.post(scenario)
        for scenario in (*REQUESTS, *WEBHOOKS):  # warm up: imports, connections, caches
            for _ in range(50):
                client.sample(scenario)
        profiles = {scenario: profile(client, scenario, args) for scenario in PROFILED}
        inbox = {"inbox-database": profile(client, "inbox-database", args)}
        return "\n\n".join(
            [
                f"In this process, no server: the median of {args.requests} requests of each "
                "scenario, alternated request by request.",
                costs(client, REQUESTS, args.requests),
                statements_section(client, PROFILED, args.requests),
                f"Webhooks: the median of {args.requests} events of each scenario, each delivered "
                "twice (new, then a duplicate), alternated event by event; per request. Their "
                "statements: the event's recording, then the duplicate's.",
                costs(client, WEBHOOKS, args.requests),
                statements_section(client, WEBHOOKS, args.requests),
                breakdown(profiles, PARTS, args.requests),
                breakdown(inbox, INBOX_PARTS, args.requests),
            ]
        )
    finally:
        from django.db import connections  # noqa: PLC0415

        connections.close_all()
        drop_database(DATABASE)


def main() -> None:
    print(measure(parse_arguments()))


if __name__ == "__main__":
    main()
