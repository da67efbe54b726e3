#!/usr/bin/env python
"""Measure what idempotency costs: the example app under gunicorn on PostgreSQL, driven by wrk.

Scenarios, alternated round by round (each round starting one scenario later) so that every
ratio comes from one run:
  bare    POST to the payment view without IdempotentMixin
  fresh   POST to the idempotent payment view, a new key each time
  replay  POST to the idempotent payment view, always the same key (every answer a replay)
  naive-fresh, naive-replay  the same against a deliberately naive idempotent view (naive.py):
          the floor, two statements and nothing else
  cached-fresh, cached-replay  the same idempotent view with the replay cache on Redis
  naive-cached-replay  the naive view behind the same Redis, same key each time: one GET
  bare-webhook  signed webhooks to a view that only inserts the body into a table
  naive-webhook  the same webhooks to a naive inbox (naive.py): check the signature, insert
                the event on a unique index of its id
  inbox         the same webhooks to the inbox's receiver, which verifies, records once and
                enqueues to Celery (Redis); every event is delivered twice: 50% duplicates
  inbox-inline  the same with INBOX_RUNNER "inline": the handler runs in the request, after
                the commit
  inbox-database  the same with INBOX_RUNNER "database": the request only records, and one
                `idempotency_inbox --forever` worker processes. The worker is paused during the
                measurement, so that the figure is the ingest's alone; it processes afterwards
  inbox-database-worker  the same with the worker running on the same cores
                Each runner has its own gunicorn. For inbox-inline and inbox-database-worker, the
                processing latency too (recorded -> handler done, p50 and p95)
Every run checks its effects: one payment and one key per fresh request, none per replay.
Then, once a round, a burst of 64 POSTs with one key sent at once: the effects in the database,
the answers, and the time to the last answer.
With --sweep 1 2 4 ..., bare, fresh and replay again at each of those numbers of connections,
alternated the same way, for a plot of throughput against concurrency (--plot PATH draws it).
With --purge-rows N, fresh POSTs alone and while a throttled purge deletes N expired keys.

With --database mariadb, all of it but the purge on MariaDB instead. With --worker-class
gthread, gunicorn runs threaded workers (4 workers x 4 threads by default) instead of sync ones.

Prints Markdown tables. Needs wrk (Debian package "wrk"), a PostgreSQL server
(PGHOST/PGPORT/PGUSER, default 127.0.0.1:5432/postgres) or a MariaDB server (MARIADB_HOST,
MARIADB_PORT, MARIADB_USER, MARIADB_PASSWORD, default 127.0.0.1:3306/root; the mariadb extra) and
Redis on 127.0.0.1:6379 (databases 13 and 15 are flushed); the plot needs matplotlib (in the
bench extra).
Usage: python benchmarks/run.py [--database D] [--duration S] [--rounds N] [--sweep N ...] ...
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT
from benchmarks.databases import DATABASES, NAIVE_EVENT_TABLE, NAIVE_TABLE, scalar

if TYPE_CHECKING:
    from collections.abc import Iterator

DATABASE = os.environ.get("BENCH_DATABASE", "idempotency_bench")
REDIS_DB = int(os.environ.get("BENCH_REDIS_DB", "13"))
BODY = json.dumps({"amount": 1250, "currency": "EUR", "description": "benchmark"})
AUTH = "Basic " + base64.b64encode(b"alice:password").decode()

# thread:set() sets a global of the thread's script: those globals must not be shadowed by locals.
LUA = """
local counter = 0
thread_id = 0
threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end
function request()
  counter = counter + 1
  local headers = {["Content-Type"] = "application/json", ["Authorization"] = "%(auth)s"}
  local key = "%(key)s"
  if key == "" then
    key = string.format("%(prefix)s-%%d-%%d", thread_id, counter)
  end
  if key ~= "none" then headers["Idempotency-Key"] = key end
  return wrk.format("POST", "%(path)s", headers, '%(body)s')
end
"""

SCENARIOS = {
    "bare": {"path": "/bench/bare/payments/", "key": "none"},
    "fresh": {"path": "/api/payments/", "key": ""},
    "replay": {"path": "/api/payments/", "key": "the-one-key"},
    "naive-fresh": {"path": "/bench/naive/payments/", "key": ""},
    "naive-replay": {"path": "/bench/naive/payments/", "key": "the-one-key"},
    "cached-fresh": {"path": "/bench/cached/payments/", "key": ""},
    "cached-replay": {"path": "/bench/cached/payments/", "key": "the-one-key"},
    "naive-cached-replay": {"path": "/bench/naive/cached/payments/", "key": "the-one-key"},
    "bare-webhook": {"path": "/bench/bare/webhooks/"},
    "naive-webhook": {"path": "/bench/naive/webhooks/"},
    "inbox": {"path": "/webhooks/provider/"},
    "inbox-inline": {"path": "/webhooks/provider/", "runner": "inline"},
    "inbox-database": {"path": "/webhooks/provider/", "runner": "database", "pause": "worker"},
    "inbox-database-worker": {"path": "/webhooks/provider/", "runner": "database"},
}
WEBHOOK_SCENARIOS = (
    "bare-webhook",
    "naive-webhook",
    "inbox",
    "inbox-inline",
    "inbox-database",
    "inbox-database-worker",
)
# The inbox runners that process during the measurement, each served by its own gunicorn.
PROCESSING_RUNNERS = ("inline", "database")
# The scenarios whose events are processed as they come; after the rounds, each also gets
# AT_REST_EVENTS events one at a time, each once the one before is processed.
AT_REST_SCENARIOS = ("inbox-inline", "inbox-database-worker")
AT_REST_EVENTS = 20
SWEEP_SCENARIOS = ("bare", "fresh", "replay")
REQUEST_SCENARIOS = (
    "bare", "fresh", "replay", "naive-fresh", "naive-replay", "cached-fresh", "cached-replay",
    "naive-cached-replay",
)  # fmt: skip

# Webhooks need a signature per event, which wrk cannot compute: each round's script carries
# events signed beforehand, and each thread sends each of its events twice.
WEBHOOK_LUA = """
local events = {%(events)s}
local counter = 0
thread_id, threads = 0, 0
function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
  thread:set("threads", %(threads)d)
end
function request()
  local index = (math.floor(counter / 2) * threads + thread_id - 1) %% #events + 1
  counter = counter + 1
  local event = events[index]
  local headers = {["Content-Type"] = "application/json", ["Stripe-Signature"] = event[2]}
  return wrk.format("POST", "%(path)s", headers, event[1])
end
"""

# wrk's figures of one run: requests, rps, p50 and p99 (milliseconds).
Measure = dict[str, float]
Runs = dict[str, list[Measure]]


@dataclasses.dataclass
class Server:
    """The example app under gunicorn: its address and its processes' environment."""

    base: str
    env: dict[str, str]
    database: str  # the name of the server in DATABASES
    # Where the servers of the other inbox runners answer, by runner.
    runners: dict[str, str] = dataclasses.field(default_factory=dict)
    worker_pid: int = 0  # the "database" runner's worker

    def base_of(self, scenario: str) -> str:
        runner = SCENARIOS[scenario].get("runner")
        return self.base if runner is None else self.runners[runner]


@dataclasses.dataclass
class Results:
    """Everything one run measured, round by round."""

    rounds: Runs
    bursts: list[dict[str, Any]]
    sweep: dict[str, dict[int, list[Measure]]] = dataclasses.field(default_factory=dict)
    during_purge: Runs = dataclasses.field(default_factory=dict)
    purges: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # The processing latency of events sent one at a time, by scenario.
    at_rest: dict[str, Measure] = dataclasses.field(default_factory=dict)


def environment(port: int, database: str) -> dict[str, str]:
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "example_project")])
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
        "DATABASE_URL": DATABASES[database].url(DATABASE),
        "PYTHONPATH": pythonpath,
        "BENCH_PORT": str(port),
    }


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "example_project" / "manage.py"), *args], env=env, check=True
    )


def prepare_database(env: dict[str, str], database: str, name: str = DATABASE) -> None:
    """Create the database ``name`` anew on the server ``database``, as ``env`` finds it."""
    server = DATABASES[database]
    server.recreate(name)
    manage(env, "migrate", "--verbosity", "0")
    with server.connect(name) as connection, connection.cursor() as cursor:
        cursor.execute(server.bare_table)
        cursor.execute(server.naive_table)
        cursor.execute(server.naive_event_table)
    import redis  # noqa: PLC0415

    redis.Redis(db=REDIS_DB).flushdb()
    redis.Redis(db=15).flushdb()  # the cached-* scenarios' replay cache
    manage(
        env,
        "shell",
        "--verbosity",
        "0",
        "-c",
        "from django.contrib.auth.models import User; "
        "User.objects.create_user('alice', password='password')",
    )


def wait_until_up(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)  # noqa: S310 - loopback only
        except urllib.error.HTTPError:
            return  # any HTTP answer means the server is up
        except OSError:
            time.sleep(0.2)
        else:
            return
    raise SystemExit(f"the server did not answer at {url}")


@contextlib.contextmanager
def serve(args: argparse.Namespace) -> Iterator[Server]:
    """A new database and gunicorn serving the example on it; both gone afterwards."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    env = environment(args.port, args.database)
    try:
        prepare_database(env, args.database)
        processes = [gunicorn(args, env, args.port)]
        runners = {}
        for offset, runner in enumerate(PROCESSING_RUNNERS, 1):
            runner_env = {**env, "BENCH_INBOX_RUNNER": runner}
            processes.append(gunicorn(args, runner_env, args.port + offset))
            runners[runner] = f"http://127.0.0.1:{args.port + offset}"
        # The "database" runner's worker, running all along as in production.
        worker = [str(ROOT / "example_project" / "manage.py"), "idempotency_inbox", "--forever"]
        processes.append(
            subprocess.Popen(
                [sys.executable, *worker, "--no-purge"], env=env, stdout=subprocess.DEVNULL
            )
        )
        worker_pid = processes[-1].pid
        try:
            base = f"http://127.0.0.1:{args.port}"
            for url in [base, *runners.values()]:
                wait_until_up(url + "/api/payments/")
            server = Server(base, env, args.database, runners, worker_pid)
            seed_replays(server)
            yield server
        finally:
            os.kill(worker_pid, signal.SIGCONT)
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)
    finally:
        DATABASES[args.database].drop(DATABASE)


def gunicorn(args: argparse.Namespace, env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "gunicorn", "benchmarks.wsgi", "--workers", str(args.workers),
        "--worker-class", args.worker_class, "--threads", str(worker_threads(args)),
        "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, cwd=ROOT)


@functools.cache
def signer() -> Any:
    """The inbox's Stripe signer with the example's secrets: sets Django up in this process."""
    sys.path[:0] = [str(ROOT), str(ROOT / "example_project")]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
    import django  # noqa: PLC0415 - the signer reads the example's settings

    django.setup()
    from django.conf import settings  # noqa: PLC0415

    from django_idempotency.signing import StripeSignature  # noqa: PLC0415

    return StripeSignature(settings.PROVIDER_WEBHOOK_SECRETS)


def webhook_script(path: str, duration: int, threads: int, prefix: str) -> str:
    # Enough unique events for 4,000 requests a second: they are not sent again in the round.
    events = []
    for n in range(duration * 2_000):
        body = json.dumps(
            {
                "id": f"evt_{prefix}_{n}",
                "type": "refund.succeeded",
                # The example's handler applies a refund's status if its sequence is newer.
                "data": {"refund": n, "sequence": 1},
            }
        ).encode()
        header = signer().sign(body)["Stripe-Signature"]
        events.append("{[[%s]], [[%s]]}" % (body.decode(), header))  # noqa: UP031 - Lua syntax
    return WEBHOOK_LUA % {"events": ",\n".join(events), "threads": threads, "path": path}


def run_wrk(
    server: Server,
    scenario: str,
    args: argparse.Namespace,
    round_no: int,
    *,
    connections: int | None = None,
    duration: int | None = None,
) -> Measure:
    """One wrk run of ``scenario``: by default ``args.connections`` for ``args.duration`` s."""
    connections = connections or args.connections
    duration = duration or args.duration
    threads = min(args.threads, connections)  # wrk needs a connection per thread at least
    spec = SCENARIOS[scenario]
    prefix = f"r{round_no}-{time.time_ns()}"
    if scenario in WEBHOOK_SCENARIOS:
        script = webhook_script(spec["path"], duration, threads, prefix)
    else:
        script = payment_script(spec["path"], spec["key"], prefix)
    return wrk(
        server.base_of(scenario),
        script,
        scenario,
        threads=threads,
        connections=connections,
        duration=duration,
    )


def payment_script(path: str, key: str, prefix: str) -> str:
    """wrk's script that POSTs a payment to ``path`` with ``key``: ``""`` for a new key each
    time (named after ``prefix``), ``"none"`` for none."""
    return LUA % {"auth": AUTH, "key": key, "prefix": prefix, "path": path, "body": BODY}


def wrk(
    base: str, script: str, scenario: str, *, threads: int, connections: int, duration: int
) -> Measure:
    """Run wrk's ``script`` against ``base``; fail on any answer but a 2xx or 3xx."""
    with wrk_command(base, script, threads, connections, duration) as command:
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return parse_wrk(output, scenario, connections)


@contextlib.contextmanager
def wrk_command(
    base: str, script: str, threads: int, connections: int, duration: int
) -> Iterator[list[str]]:
    """wrk's command line for ``script``, which is written to a file for as long as it runs."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
    try:
        yield [
            "wrk", "--latency", "--timeout", "30s", "-t", str(threads), "-c", str(connections),
            "-d", f"{duration}s", "-s", handle.name, base,
        ]  # fmt: skip
    finally:
        Path(handle.name).unlink()


def parse_wrk(output: str, scenario: str, connections: int) -> Measure:
    """wrk's report: requests, requests per second, p50 and p99; fail on any answer but a 2xx or
    3xx."""
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if errors:
        raise SystemExit(f"{scenario}: {errors.group(1)} non-2xx answers\n{output}")
    socket_errors = re.search(r"Socket errors: .*", output)
    if socket_errors:
        print(f"{scenario}, {connections} connections: {socket_errors.group()}", file=sys.stderr)
    return {
        "requests": float(re.search(r"(\d+) requests in", output).group(1)),  # type: ignore[union-attr]
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),  # type: ignore[union-attr]
        "p50": _millis(re.search(r"50%\s+([\d.]+\w+)", output).group(1)),  # type: ignore[union-attr]
        "p99": _millis(re.search(r"99%\s+([\d.]+\w+)", output).group(1)),  # type: ignore[union-attr]
    }


# What each scenario must have written, in rows per request: proof that the load was what it
# says it is. A replay writes no row at all.
TABLES = {
    "payments": "payments_payment",
    "keys": "django_idempotency_idempotencykey",
    "naive keys": NAIVE_TABLE,
    "events": "bench_bare_event",
    "naive events": NAIVE_EVENT_TABLE,
    "inbox events": "django_idempotency_inboxevent",
}
COUNTS: dict[str, dict[str, float]] = {
    "bare": {"payments": 1.0, "keys": 0.0, "naive keys": 0.0},
    "fresh": {"payments": 1.0, "keys": 1.0},
    "replay": {"payments": 0.0, "keys": 0.0},
    "naive-fresh": {"payments": 1.0, "naive keys": 1.0},
    "naive-replay": {"payments": 0.0, "naive keys": 0.0},
    "cached-fresh": {"payments": 1.0, "keys": 1.0},
    "cached-replay": {"payments": 0.0, "keys": 0.0},
    "naive-cached-replay": {"payments": 0.0, "naive keys": 0.0},
    "bare-webhook": {"events": 1.0},
    "naive-webhook": {"naive events": 0.5},
    "inbox": {"inbox events": 0.5},
    "inbox-inline": {"inbox events": 0.5},
    "inbox-database": {"inbox events": 0.5},
    "inbox-database-worker": {"inbox events": 0.5},
}


def rows_created(server: Server, scenario: str) -> dict[str, int]:
    with DATABASES[server.database].connect(DATABASE) as connection:
        return {
            name: scalar(connection, f"SELECT count(*) FROM {TABLES[name]}")
            for name in COUNTS[scenario]
        }


def settled_rows(server: Server, scenario: str) -> dict[str, int]:
    """``rows_created`` once the requests that wrk left in flight have written theirs."""
    rows = rows_created(server, scenario)
    while True:
        time.sleep(0.1)
        again = rows_created(server, scenario)
        if again == rows:
            return rows
        rows = again


def seed_replays(server: Server) -> None:
    """Store the one key of each replay scenario, so that every request they send is a replay."""
    for scenario in ("replay", "naive-replay", "cached-replay", "naive-cached-replay"):
        spec = SCENARIOS[scenario]
        seed_key(server.base, spec["path"], spec["key"])


def seed_key(base: str, path: str, key: str) -> None:
    """POST the payment to ``path`` with ``key`` once, so that every later request replays."""
    request = urllib.request.Request(  # noqa: S310 - loopback only
        base + path,
        data=BODY.encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": AUTH, "Idempotency-Key": key},
    )
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
        if response.status != 201:  # pragma: no cover - urlopen raises for 4xx and 5xx
            raise SystemExit(f"{path}: seeding its key answered {response.status}")


def checked_run(
    server: Server,
    scenario: str,
    args: argparse.Namespace,
    round_no: int,
    *,
    connections: int | None = None,
    duration: int | None = None,
) -> Measure:
    """``run_wrk``, failing unless the scenario wrote the rows of ``COUNTS`` per request.

    For an inbox runner that processes, also fail unless every event was processed, and add the
    processing latency's p50 and p95 (milliseconds).
    """
    before = settled_rows(server, scenario)
    last_event = latest_event(server)
    paused = SCENARIOS[scenario].get("pause") == "worker"
    if paused:
        os.kill(server.worker_pid, signal.SIGSTOP)
    try:
        measured = run_wrk(
            server, scenario, args, round_no, connections=connections, duration=duration
        )
    finally:
        if paused:
            os.kill(server.worker_pid, signal.SIGCONT)
    after = settled_rows(server, scenario)
    if SCENARIOS[scenario].get("runner") in PROCESSING_RUNNERS:
        # Each round drains what it recorded before the next scenario starts.
        latency = processing_latency(server, scenario, last_event)
        if not paused:  # a paused worker's latency is the pause's
            measured.update(latency)
    elif scenario == "inbox":
        park_unprocessed(server)
    for rows, share in COUNTS[scenario].items():
        expected = measured["requests"] * share
        written = after[rows] - before[rows]
        # Requests still in flight when wrk stops are written but not counted; none is a
        # replay's only allowance.
        slack = (connections or args.connections) if share else 0
        if not expected <= written <= expected + slack:
            raise SystemExit(
                f"{scenario}: {written} {rows} for {measured['requests']:.0f} requests"
            )
    return measured


def latest_event(server: Server) -> int:
    with DATABASES[server.database].connect(DATABASE) as connection:
        return int(scalar(connection, f"SELECT coalesce(max(id), 0) FROM {TABLES['inbox events']}"))


def processing_latency(server: Server, scenario: str, after_event: int) -> Measure:
    """Once the events recorded after ``after_event`` are processed: their latency's p50, p95
    and maximum."""
    table, where = TABLES["inbox events"], f"id > {after_event:d}"
    deadline = time.monotonic() + 600
    with DATABASES[server.database].connect(DATABASE) as connection:
        pending = f"SELECT count(*) FROM {table} WHERE {where} AND status <> 'processed'"
        while scalar(connection, pending):
            if time.monotonic() > deadline:
                raise SystemExit(f"{scenario}: events left unprocessed")
            time.sleep(0.1)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT received_at, processed_at FROM {table} WHERE {where}")
            seconds = sorted((done - received).total_seconds() for received, done in cursor)
    if not seconds:
        raise SystemExit(f"{scenario}: no event recorded")
    return {
        "latency_p50": 1000 * seconds[len(seconds) // 2],
        "latency_p95": 1000 * seconds[min(len(seconds) - 1, int(len(seconds) * 0.95))],
        "latency_max": 1000 * seconds[-1],
    }


def latency_at_rest(server: Server, scenario: str, events: int) -> Measure:
    """Deliver ``events`` new events to ``scenario``'s runner, each once the one before is
    processed, so that none waits for another; their processing latency's p50, p95 and maximum."""
    first = latest_event(server)
    url = server.base_of(scenario) + SCENARIOS[scenario]["path"]
    for n in range(events):
        event = {"id": f"evt_rest_{time.time_ns()}_{n}", "type": "refund.succeeded"}
        body = json.dumps({**event, "data": {"refund": n, "sequence": 1}}).encode()
        headers = {"Content-Type": "application/json", **signer().sign(body)}
        request = urllib.request.Request(url, data=body, method="POST", headers=headers)  # noqa: S310
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - loopback only
            if response.status != 200:  # pragma: no cover - urlopen raises for 4xx and 5xx
                raise SystemExit(f"{scenario}: an event at rest answered {response.status}")
        processing_latency(server, scenario, first + n)  # waits until it is processed
    return processing_latency(server, scenario, first)


def park_unprocessed(server: Server) -> None:
    """Take the Celery scenario's events, which no Celery worker processes, off the schedule.

    Otherwise the "database" runner's worker would process them a minute later, in the middle of
    another scenario.
    """
    with DATABASES[server.database].connect(DATABASE) as connection, connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLES['inbox events']} SET next_attempt_at = NULL WHERE status = 'received'"
        )


def _millis(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--database", choices=list(DATABASES), default="postgresql", help="the server to run on"
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds per scenario and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument(
        "--worker-class",
        choices=["sync", "gthread"],
        default="sync",
        help="gunicorn's worker class",
    )
    parser.add_argument("--workers", type=int, help="gunicorn workers (2 sync, 4 gthread)")
    parser.add_argument("--worker-threads", type=int, help="threads per gthread worker (4)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--purge-rows",
        type=int,
        default=0,
        help="also time fresh POSTs while a throttled purge deletes this many expired keys",
    )
    parser.add_argument(
        "--burst", type=int, default=64, help="same-key requests sent at once, once a round"
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[],
        metavar="N",
        help="also run bare, fresh and replay at each of these numbers of connections",
    )
    parser.add_argument(
        "--sweep-duration", type=int, default=5, help="seconds per scenario, level and round"
    )
    parser.add_argument("--plot", type=Path, help="draw the sweep's throughput into this PNG")
    args = parser.parse_args(argv)
    if args.workers is None:
        args.workers = 4 if args.worker_class == "gthread" else 2
    return args


def worker_threads(args: argparse.Namespace) -> int:
    """Threads per gunicorn worker: 1 for sync workers, else ``--worker-threads`` (4)."""
    if args.worker_class == "sync":
        return 1
    return args.worker_threads or 4


def measure(args: argparse.Namespace) -> Results:
    """Serve the example and run every scenario that ``args`` asks for."""
    if args.purge_rows and args.database != "postgresql":
        raise SystemExit("--purge-rows fills the table in PostgreSQL's SQL: PostgreSQL only")
    with serve(args) as server:
        rounds: Runs = {name: [] for name in SCENARIOS}
        names = list(SCENARIOS)
        for round_no in range(args.rounds + 1):  # round 0 warms up and is not counted
            # Each round starts one scenario later: none always follows the same one (the
            # webhooks' writes, say), nor always runs first.
            for scenario in names[round_no % len(names) :] + names[: round_no % len(names)]:
                measured = checked_run(server, scenario, args, round_no)
                if round_no:
                    rounds[scenario].append(measured)
        results = Results(rounds, [burst(server, args.burst) for _ in range(args.rounds)])
        check_bursts(results.bursts)
        results.at_rest = {
            scenario: latency_at_rest(server, scenario, AT_REST_EVENTS)
            for scenario in AT_REST_SCENARIOS
        }
        if args.sweep:
            results.sweep = measure_sweep(server, args)
        if args.purge_rows:
            results.during_purge, results.purges = measure_during_purge(server, args)
    return results


def measure_sweep(server: Server, args: argparse.Namespace) -> dict[str, dict[int, list[Measure]]]:
    """bare, fresh and replay at each number of connections of ``args.sweep``, alternated."""
    sweep: dict[str, dict[int, list[Measure]]] = {
        scenario: {level: [] for level in args.sweep} for scenario in SWEEP_SCENARIOS
    }
    for round_no in range(1, args.rounds + 1):
        for level in args.sweep:
            for scenario in SWEEP_SCENARIOS:
                measured = checked_run(
                    server,
                    scenario,
                    args,
                    300 + round_no,
                    connections=level,
                    duration=args.sweep_duration,
                )
                sweep[scenario][level].append(measured)
    return sweep


# Set up, say so, and purge when told: starting Python and Django is not part of the purge.
PURGE = (
    "import json, sys, django; django.setup(); "
    "from django_idempotency.models import IdempotencyKey; "
    "print('ready', flush=True); sys.stdin.readline(); "
    "r = IdempotencyKey.objects.purge_expired(batch_size=10_000, pause=0.05); "
    "print(json.dumps({'deleted': r.deleted, 'seconds': r.seconds, "
    "'longest_batch': r.longest_batch}))"
)


def measure_during_purge(
    server: Server, args: argparse.Namespace
) -> tuple[Runs, list[dict[str, float]]]:
    """Fresh POSTs alone, then while a throttled purge runs, round by round."""
    import psycopg  # noqa: PLC0415

    from benchmarks.purge import FILL_SQL  # noqa: PLC0415

    results: Runs = {"alone": [], "during the purge": []}
    purges = []
    for round_no in range(1, args.rounds + 1):
        with psycopg.connect(server.env["DATABASE_URL"], autocommit=True) as connection:
            connection.execute(FILL_SQL, [args.purge_rows])
            connection.execute("VACUUM ANALYZE django_idempotency_idempotencykey")
        results["alone"].append(run_wrk(server, "fresh", args, 100 + round_no))
        purge = subprocess.Popen(
            [sys.executable, "-c", PURGE],
            env=server.env,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if purge.stdin is None or purge.stdout is None or purge.stdout.readline() != "ready\n":
            raise SystemExit("the purge did not start")
        purge.stdin.write("go\n")
        purge.stdin.flush()
        results["during the purge"].append(run_wrk(server, "fresh", args, 200 + round_no))
        output, _ = purge.communicate(timeout=600)
        if purge.returncode:
            raise SystemExit("the purge failed")
        purges.append(json.loads(output))
    return results, purges


def burst(server: Server, size: int) -> dict[str, Any]:
    """Send ``size`` identical POSTs with one key at once; count answers and effects."""
    key = f"burst-{time.time_ns()}"
    barrier = threading.Barrier(size)

    def send(_: int) -> str:
        request = urllib.request.Request(  # noqa: S310 - loopback only
            server.base + SCENARIOS["fresh"]["path"],
            data=BODY.encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Authorization": AUTH,
                "Idempotency-Key": key,
            },
        )
        barrier.wait()
        try:
            with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
                return f"{response.status} {response.headers.get('Idempotency-Status')}"
        except urllib.error.HTTPError as error:
            return f"{error.code} {json.loads(error.read()).get('code', '')}"

    count = "SELECT count(*) FROM payments_payment"
    with DATABASES[server.database].connect(DATABASE) as connection:
        before = scalar(connection, count)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            answers = list(pool.map(send, range(size)))
        seconds = time.monotonic() - started
        effects = scalar(connection, count) - before
    return {"answers": collections.Counter(answers), "effects": effects, "seconds": seconds}


def check_bursts(bursts: list[dict[str, Any]]) -> None:
    """Fail unless every burst had exactly one effect and no 5xx answer."""
    if any(result["effects"] != 1 for result in bursts):
        raise SystemExit(f"a burst did not have exactly one effect: {bursts}")
    if any(answer.startswith("5") for result in bursts for answer in result["answers"]):
        raise SystemExit(f"a burst got a 5xx answer: {bursts}")


def main() -> None:
    args = parse_arguments()
    if args.plot and not args.sweep:
        raise SystemExit("--plot draws the sweep: give --sweep too")
    from benchmarks import tables  # noqa: PLC0415 - it imports this module

    results = measure(args)
    print(tables.report(results, args))
    if args.plot:
        tables.plot(results, args, args.plot)
        print(f"\nThe plot is in {args.plot}.")


if __name__ == "__main__":
    main()
