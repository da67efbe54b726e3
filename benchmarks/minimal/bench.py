"""Measure the library in the minimal project, against a bare copy of each view and a naive floor.

    python -m benchmarks.minimal [--database postgresql|mariadb] [--duration S] [--rounds N]
                                 [--asgi]

Serves ``benchmarks/minimal`` under gunicorn (4 gthread workers x 4 threads by default; persistent
connections, HTTP Basic with the MD5 hasher), or with ``--asgi`` under uvicorn (``--workers``
processes; ``CONN_MAX_AGE = 0``, as Django advises under ASGI: every request opens its database
connection, in each scenario alike), drives it with wrk at 8 connections, and alternates
the scenarios round by round after a warm-up round, each round starting one scenario later. Every
figure is a ratio taken within a round, and the table gives the median of the rounds with their
range: each idempotent scenario against the bare view, and against its naive floor
(``benchmarks/naive.py``). ``bare-again``, the bare view once more, is the control: its ratio to
``bare`` is the noise. Every run checks its effects: a fresh request stores one payment and one key,
a replay none, the inbox one event per two deliveries.

Needs wrk, the ``bench`` extra, Redis on 127.0.0.1:6379 (its database 15 is flushed), and the
server: PostgreSQL as ``benchmarks/run.py`` finds it, or MariaDB (the ``mariadb`` extra).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import TYPE_CHECKING, cast

from benchmarks.common import ROOT, table
from benchmarks.databases import DATABASES, NAIVE_EVENT_TABLE, NAIVE_TABLE, scalar
from benchmarks.run import AUTH, BODY, LUA, WEBHOOK_LUA, Measure, wait_until_up, wrk

if TYPE_CHECKING:
    from collections.abc import Iterator

DATABASE = os.environ.get("BENCH_DATABASE", "idempotency_minimal")
SECRET = "whsec_minimal_benchmark"  # noqa: S105 - settings.WEBHOOK_SECRET
SPREAD = "spread"  # the prefix of the keys the *-spread scenarios replay, one after another

# Each scenario: its path, and its key ("" a new one each time, "none" none, SPREAD the next of
# the spread keys, anything else that one key).
SCENARIOS: dict[str, dict[str, str]] = {
    "bare": {"path": "/bare/payments/", "key": "none"},
    "bare-again": {"path": "/bare/payments/", "key": "none"},
    "fresh": {"path": "/payments/", "key": ""},
    "naive-fresh": {"path": "/naive/payments/", "key": ""},
    "replay": {"path": "/payments/", "key": "the-one-key"},
    "naive-replay": {"path": "/naive/payments/", "key": "the-one-key"},
    "replay-spread": {"path": "/payments/", "key": SPREAD},
    "naive-replay-spread": {"path": "/naive/payments/", "key": SPREAD},
    "cached-fresh": {"path": "/cached/payments/", "key": ""},
    "cached-replay": {"path": "/cached/payments/", "key": "the-one-key"},
    "naive-cached-replay": {"path": "/naive/cached/payments/", "key": "the-one-key"},
    "bare-webhook": {"path": "/bare/webhooks/"},
    "naive-webhook": {"path": "/naive/webhooks/"},
    "inbox-database": {"path": "/webhooks/"},
}
DESCRIPTIONS = {
    "bare": "the bare viewset: authenticate, validate, one insert",
    "bare-again": "the same, the control",
    "fresh": "with `IdempotentMixin`, a new key each time",
    "naive-fresh": "the naive floor, a new key each time",
    "replay": "with `IdempotentMixin`, one key from 8 connections",
    "naive-replay": "the naive floor, one key from 8 connections",
    "replay-spread": "with `IdempotentMixin`, each request another of the stored keys",
    "naive-replay-spread": "the naive floor, each request another of its stored keys",
    "cached-fresh": "with the Redis replay cache, a new key each time",
    "cached-replay": "with the Redis replay cache, one key",
    "naive-cached-replay": "the naive floor behind the same Redis, one key",
    "bare-webhook": "parse the event, insert it",
    "naive-webhook": "the naive inbox: verify, insert once by its id",
    "inbox-database": "the inbox's receiver (`database` runner): verify, record once",
}
# Each figure of the summary: a scenario, and what it is measured against in the same round.
VERSUS = [
    ("bare-again", "bare", "the control: the bare view against itself"),
    ("fresh", "naive-fresh", "fresh request"),
    ("replay", "naive-replay", "replay of one key by 8 connections"),
    ("replay-spread", "naive-replay-spread", "replay of many keys, one after another"),
    ("cached-replay", "naive-cached-replay", "replay from the Redis replay cache"),
    ("cached-fresh", "fresh", "fresh request with the replay cache on, against without"),
    ("inbox-database", "naive-webhook", "inbox ingest, 50% duplicates"),
]
# Rows written per request: proof that each load was what it says.
TABLES = {
    "payments": "minimal_payment",
    "keys": "django_idempotency_idempotencykey",
    "naive keys": NAIVE_TABLE,
    "events": "bench_bare_event",
    "naive events": NAIVE_EVENT_TABLE,
    "inbox events": "django_idempotency_inboxevent",
}
COUNTS: dict[str, dict[str, float]] = {
    "bare": {"payments": 1, "keys": 0, "naive keys": 0},
    "fresh": {"payments": 1, "keys": 1},
    "naive-fresh": {"payments": 1, "naive keys": 1},
    "replay": {"payments": 0, "keys": 0},
    "cached-fresh": {"payments": 1, "keys": 1},
    "bare-webhook": {"events": 1},
    "naive-webhook": {"naive events": 0.5},
    "inbox-database": {"inbox events": 0.5},
}
for _name in SCENARIOS:
    COUNTS.setdefault(_name, COUNTS["replay"] if "replay" in _name else COUNTS["bare"])

SPREAD_LUA = LUA.replace(
    'if key == "" then',
    f'if key == "{SPREAD}" then\n'
    '    key = string.format("%(prefix)s-%%d", (thread_id * 7919 + counter) %% %(keys)d)\n'
    '  elseif key == "" then',
)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--database", choices=list(DATABASES), default="postgresql")
    parser.add_argument("--duration", type=int, default=10, help="seconds per scenario and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument(
        "--asgi", action="store_true", help="serve under uvicorn, without persistent connections"
    )
    parser.add_argument("--worker-class", choices=["sync", "gthread"], default="gthread")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--worker-threads", type=int, default=4, help="threads per gthread worker")
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--spread-keys", type=int, default=2000, help="keys of the *-spread runs")
    parser.add_argument(
        "--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS), metavar="S"
    )
    return parser.parse_args(argv)


def environment(args: argparse.Namespace) -> dict[str, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.minimal.settings",
        "DATABASE_URL": DATABASES[args.database].url(DATABASE),
        "PYTHONPATH": str(ROOT),
    }
    if args.asgi:
        env["BENCH_ASGI"] = "1"
    return env


def server_command(args: argparse.Namespace) -> list[str]:
    """gunicorn's command line; or, with ``--asgi``, uvicorn's."""
    if args.asgi:
        return [
            sys.executable, "-m", "uvicorn", "benchmarks.minimal.asgi:application",
            "--host", "127.0.0.1", "--port", str(args.port), "--workers", str(args.workers),
            "--lifespan", "off", "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
    threads = 1 if args.worker_class == "sync" else args.worker_threads
    return [
        sys.executable, "-m", "gunicorn", "benchmarks.minimal.wsgi", "--workers",
        str(args.workers), "--worker-class", args.worker_class, "--threads", str(threads),
        "--bind", f"127.0.0.1:{args.port}", "--log-level", "warning",
    ]  # fmt: skip


def django_admin(env: dict[str, str], *command: str) -> None:
    command = (sys.executable, "-m", "django", *command, "--verbosity", "0")
    subprocess.run(command, env=env, cwd=ROOT, check=True)


@contextlib.contextmanager
def serve(args: argparse.Namespace) -> Iterator[str]:
    """A new database, and gunicorn (or uvicorn) serving the minimal project on it; both gone
    afterwards."""
    server, env = DATABASES[args.database], environment(args)
    server.recreate(DATABASE)
    try:
        django_admin(env, "migrate", "--run-syncdb")
        with server.connect(DATABASE) as connection, connection.cursor() as cursor:
            for statement in (server.bare_table, server.naive_table, server.naive_event_table):
                cursor.execute(statement)
        create_user = (
            "from django.contrib.auth.models import User; "
            "User.objects.create_user('alice', password='password')"
        )
        django_admin(env, "shell", "-c", create_user)
        import redis  # noqa: PLC0415 - the bench extra

        redis.Redis(db=int(os.environ.get("BENCH_CACHE_DB", "15"))).flushdb()  # settings.CACHES
        process = subprocess.Popen(server_command(args), env=env, cwd=ROOT)
        try:
            base = f"http://127.0.0.1:{args.port}"
            wait_until_up(base + "/payments/")
            yield base
        finally:
            process.terminate()
            process.wait(timeout=60)
    finally:
        server.drop(DATABASE)


def post(base: str, path: str, key: str) -> None:
    """POST the payment with ``key`` once, so that every later request with it replays."""
    headers = {"Content-Type": "application/json", "Authorization": AUTH, "Idempotency-Key": key}
    request = urllib.request.Request(base + path, BODY.encode(), headers, method="POST")  # noqa: S310
    with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - loopback only
        if response.status != 201:  # pragma: no cover - urlopen raises for 4xx and 5xx
            raise SystemExit(f"{path}: storing {key} answered {response.status}")


def seed(base: str, args: argparse.Namespace) -> None:
    """Store the keys that the replay scenarios replay."""
    keys = [(spec["path"], spec["key"]) for spec in SCENARIOS.values() if spec.get("key")]
    stored = {(path, key) for path, key in keys if key not in {"", "none", SPREAD}}
    for path in {path for path, key in keys if key == SPREAD}:
        stored.update((path, f"{SPREAD}-{n}") for n in range(args.spread_keys))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: post(base, *item), sorted(stored)))


def webhook_script(path: str, duration: int, threads: int, prefix: str) -> str:
    """Signed events enough for 4,000 requests a second, each sent twice."""
    events = []
    for n in range(duration * 2_000):
        body = json.dumps({"id": f"evt_{prefix}_{n}", "type": "refund.succeeded", "data": {}})
        timestamp = int(time.time())
        signed = f"{timestamp}.{body}".encode()
        signature = hmac.new(SECRET.encode(), signed, hashlib.sha256).hexdigest()
        events.append(f"{{[[{body}]], [[t={timestamp},v1={signature}]]}}")
    return WEBHOOK_LUA % {"events": ",\n".join(events), "threads": threads, "path": path}


def rows(args: argparse.Namespace) -> dict[str, int]:
    with DATABASES[args.database].connect(DATABASE) as connection:
        return {name: scalar(connection, f"SELECT count(*) FROM {t}") for name, t in TABLES.items()}


def settled_rows(args: argparse.Namespace) -> dict[str, int]:
    """``rows`` once the requests that wrk left in flight have written theirs."""
    counted = rows(args)
    while True:
        time.sleep(0.1)
        if (again := rows(args)) == counted:
            return counted
        counted = again


def sessions(args: argparse.Namespace) -> int | None:
    """How many connections the server has accepted to the project's database so far: on
    PostgreSQL, from its statistics, asked over a connection to another database; else None."""
    if args.database != "postgresql":
        return None
    with DATABASES[args.database].connect("postgres") as connection:
        counted = scalar(
            connection, "SELECT sessions FROM pg_stat_database WHERE datname = %s", [DATABASE]
        )
    return int(counted)


def run(base: str, scenario: str, args: argparse.Namespace, round_no: int) -> Measure:
    """One wrk run of ``scenario``, failing unless it wrote the rows of ``COUNTS`` per request."""
    spec, threads = SCENARIOS[scenario], min(args.threads, args.connections)
    prefix = f"r{round_no}-{time.time_ns()}"
    if "key" not in spec:
        script = webhook_script(spec["path"], args.duration, threads, prefix)
    else:
        key_prefix = SPREAD if spec["key"] == SPREAD else prefix
        values = {"auth": AUTH, "key": spec["key"], "prefix": key_prefix, "path": spec["path"]}
        script = SPREAD_LUA % {**values, "body": BODY, "keys": args.spread_keys}
    before = settled_rows(args)
    connected = sessions(args)
    measured = wrk(
        base,
        script,
        scenario,
        threads=threads,
        connections=args.connections,
        duration=args.duration,
    )
    if connected is not None:
        # The answers in flight when wrk stopped, and the statistics of the connections that
        # served them, settle meanwhile.
        time.sleep(1)
        opened = cast("int", sessions(args)) - connected
        measured["connects"] = max(0, opened - args.connections) / measured["requests"]
    after = settled_rows(args)
    for name, share in COUNTS[scenario].items():
        expected, written = measured["requests"] * share, after[name] - before[name]
        slack = args.connections if share else 0  # requests in flight when wrk stopped
        if not expected <= written <= expected + slack:
            requests = f"{measured['requests']:.0f} requests"
            raise SystemExit(f"{scenario}: {written} {name} for {requests}")
    return measured


def measure(args: argparse.Namespace) -> dict[str, list[Measure]]:
    rounds: dict[str, list[Measure]] = {name: [] for name in args.scenarios}
    with serve(args) as base:
        seed(base, args)
        names = list(args.scenarios)
        for round_no in range(args.rounds + 1):  # round 0 warms up and is not counted
            shift = round_no % len(names)
            for scenario in names[shift:] + names[:shift]:
                print(f"round {round_no}: {scenario}", file=sys.stderr, flush=True)
                measured = run(base, scenario, args, round_no)
                if round_no:
                    rounds[scenario].append(measured)
    return rounds


def spread(values: list[float]) -> str:
    """The median of ``values``, with their range when there are several."""
    middle = f"**{statistics.median(values):.2f}**"
    return middle if len(values) == 1 else f"{middle} [{min(values):.2f} to {max(values):.2f}]"


def report(rounds: dict[str, list[Measure]], args: argparse.Namespace) -> str:
    threads = 1 if args.worker_class == "sync" else args.worker_threads
    server = (
        f"uvicorn {args.workers} workers, CONN_MAX_AGE = 0"
        if args.asgi
        else f"gunicorn {args.workers} {args.worker_class} workers x {threads} threads"
    )
    lines = [
        f"{args.rounds} rounds x {args.duration} s after a warm-up round, "
        f"{args.connections} connections, on {DATABASES[args.database].title}; {server}. "
        "Ratios are taken within each round: the median of the rounds, [the lowest to the "
        "highest].",
        "",
    ]
    versus = [(a, b, what) for a, b, what in VERSUS if a in rounds and b in rounds]
    lines.append(
        table(
            ["figure", "ours / against", "ratio"],
            [[what, f"`{a}` / `{b}`", spread(ratios(rounds, a, b))] for a, b, what in versus],
        )
    )
    lines.append("")
    header = ["scenario", "req/s (median)", "vs bare", "p50", "p99"]
    connects = all("connects" in run for runs in rounds.values() for run in runs)
    if connects:
        header.append("connections per request")
    body = []
    for name, runs in rounds.items():
        against = "bare-webhook" if "key" not in SCENARIOS[name] else "bare"
        middle = {m: statistics.median(run[m] for run in runs) for m in ("rps", "p50", "p99")}
        vs = spread(ratios(rounds, name, against)) if against in rounds else ""
        row = [
            f"`{name}`: {DESCRIPTIONS[name]}",
            f"{middle['rps']:,.0f}",
            vs,
            f"{middle['p50']:.1f} ms",
            f"{middle['p99']:.1f} ms",
        ]
        if connects:
            row.append(f"{max(run['connects'] for run in runs):.3f}")
        body.append(row)
    lines.append(table(header, body))
    if connects:
        lines += [
            "",
            "Connections per request: the connections PostgreSQL accepted to the database during "
            "the scenario's runs (less one per wrk connection, for the answers in flight at the "
            "end), over the requests answered; the highest of the rounds.",
        ]
    return "\n".join(lines)


def ratios(rounds: dict[str, list[Measure]], scenario: str, against: str) -> list[float]:
    """``scenario``'s requests per second over ``against``'s, round by round."""
    return [
        mine["rps"] / theirs["rps"]
        for mine, theirs in zip(rounds[scenario], rounds[against], strict=True)
    ]


def main() -> None:
    args = parse_arguments()
    print(f"```bash\npython -m benchmarks.minimal {' '.join(sys.argv[1:])}\n```\n")
    print(report(measure(args), args))
