#!/usr/bin/env python
"""Measure what idempotency costs: the example app under gunicorn on PostgreSQL, driven by wrk.

Scenarios, alternated round by round so that every ratio comes from one run:
  bare    POST to the payment view without IdempotentMixin
  fresh   POST to the idempotent payment view, a new key each time
  replay  POST to the idempotent payment view, always the same key (every answer a replay)
  bare-webhook  signed webhooks to a view that only inserts the body into a table
  inbox         the same webhooks to the inbox's receiver, which verifies, records once and
                enqueues to Celery (Redis); every event is delivered twice: 50% duplicates
Then, once a round, a burst of 64 POSTs with one key sent at once: the effects in the database,
the answers, and the time to the last answer.

Needs wrk (Debian package "wrk"), a PostgreSQL server (PGHOST/PGPORT/PGUSER, default
127.0.0.1:5432/postgres) and Redis on 127.0.0.1:6379 (database 13 is flushed).
Usage: python benchmarks/run.py [--duration S] [--rounds N] ...
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "idempotency_bench"
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
    "bare-webhook": {"path": "/bench/bare/webhooks/"},
    "inbox": {"path": "/webhooks/provider/"},
}
WEBHOOK_SCENARIOS = ("bare-webhook", "inbox")

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


def environment(port: int) -> dict[str, str]:
    host = os.environ.get("PGHOST", "127.0.0.1")
    user = os.environ.get("PGUSER", "postgres")
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "example_project")])
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
        "DATABASE_URL": f"postgres://{user}@{host}:{os.environ.get('PGPORT', '5432')}/{DATABASE}",
        "PYTHONPATH": pythonpath,
        "BENCH_PORT": str(port),
    }


def manage(env: dict[str, str], *args: str) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "example_project" / "manage.py"), *args], env=env, check=True
    )


def prepare_database(env: dict[str, str]) -> None:
    import psycopg  # noqa: PLC0415 - only the benchmark needs it at this point

    admin = {
        "host": os.environ.get("PGHOST", "127.0.0.1"),
        "port": os.environ.get("PGPORT", "5432"),
        "user": os.environ.get("PGUSER", "postgres"),
        "dbname": "postgres",
        "autocommit": True,
    }
    with psycopg.connect(**admin) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {DATABASE}")
    manage(env, "migrate", "--verbosity", "0")
    with psycopg.connect(env["DATABASE_URL"], autocommit=True) as connection:
        connection.execute(
            "CREATE TABLE bench_bare_event (id bigserial PRIMARY KEY, event_id text, payload jsonb)"
        )
    import redis  # noqa: PLC0415

    redis.Redis(db=13).flushdb()
    manage(
        env,
        "shell",
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


def webhook_script(path: str, args: argparse.Namespace, prefix: str) -> str:
    sys.path[:0] = [str(ROOT), str(ROOT / "example_project")]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
    import django  # noqa: PLC0415 - the signer reads the example's settings

    django.setup()
    from django.conf import settings  # noqa: PLC0415

    from django_idempotency.inbox import StripeSignature  # noqa: PLC0415

    signer = StripeSignature(settings.PROVIDER_WEBHOOK_SECRETS)
    # Enough unique events for 4,000 requests a second: they are not sent again in the round.
    events = []
    for n in range(args.duration * 2_000):
        body = json.dumps(
            {"id": f"evt_{prefix}_{n}", "type": "refund.succeeded", "data": {"refund": n}}
        ).encode()
        header = signer.sign(body)["Stripe-Signature"]
        events.append("{[[%s]], [[%s]]}" % (body.decode(), header))  # noqa: UP031 - Lua syntax
    return WEBHOOK_LUA % {"events": ",\n".join(events), "threads": args.threads, "path": path}


def run_wrk(base: str, scenario: str, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    spec = SCENARIOS[scenario]
    prefix = f"r{round_no}-{time.time_ns()}"
    if scenario in WEBHOOK_SCENARIOS:
        script = webhook_script(spec["path"], args, prefix)
    else:
        script = LUA % {
            "auth": AUTH,
            "key": spec["key"],
            "prefix": prefix,
            "path": spec["path"],
            "body": BODY,
        }
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
    command = [
        "wrk", "--latency", "-t", str(args.threads), "-c", str(args.connections),
        "-d", f"{args.duration}s", "-s", handle.name, base,
    ]  # fmt: skip
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    Path(handle.name).unlink()
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if errors:
        raise SystemExit(f"{scenario}: {errors.group(1)} non-2xx answers\n{output}")
    return {
        "requests": float(re.search(r"(\d+) requests in", output).group(1)),  # type: ignore[union-attr]
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),  # type: ignore[union-attr]
        "p50": _millis(re.search(r"50%\s+([\d.]+\w+)", output).group(1)),  # type: ignore[union-attr]
        "p99": _millis(re.search(r"99%\s+([\d.]+\w+)", output).group(1)),  # type: ignore[union-attr]
    }


# What each scenario must have written: proof that the load was what it says it is.
COUNTS = {
    "fresh": ("SELECT count(*) FROM django_idempotency_idempotencykey", 1.0),
    "bare-webhook": ("SELECT count(*) FROM bench_bare_event", 1.0),
    "inbox": ("SELECT count(*) FROM django_idempotency_inboxevent", 0.5),
}


def rows_created(env: dict[str, str]) -> dict[str, int]:
    import psycopg  # noqa: PLC0415

    with psycopg.connect(env["DATABASE_URL"], autocommit=True) as connection:
        return {
            name: connection.execute(sql).fetchone()[0]  # type: ignore[index]
            for name, (sql, _share) in COUNTS.items()
        }


def check_rows(
    scenario: str,
    measured: dict[str, float],
    before: dict[str, int],
    after: dict[str, int],
    args: argparse.Namespace,
) -> None:
    """Fail unless ``scenario`` wrote one row per request (fresh keys), or per two (webhooks)."""
    if scenario not in COUNTS:
        return
    expected = measured["requests"] * COUNTS[scenario][1]
    written = after[scenario] - before[scenario]
    # Requests still in flight when wrk stops are written but not counted.
    if not expected <= written <= expected + args.connections:
        raise SystemExit(f"{scenario}: {written} rows for {measured['requests']:.0f} requests")


def _millis(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per scenario and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument("--workers", type=int, default=2, help="gunicorn sync workers")
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
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")

    env = environment(args.port)
    prepare_database(env)
    gunicorn = [
        sys.executable, "-m", "gunicorn", "benchmarks.wsgi", "--workers", str(args.workers),
        "--bind", f"127.0.0.1:{args.port}", "--log-level", "warning",
    ]  # fmt: skip
    server = subprocess.Popen(gunicorn, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_until_up(base + "/api/payments/")
        results: dict[str, list[dict[str, float]]] = {name: [] for name in SCENARIOS}
        for round_no in range(args.rounds + 1):  # round 0 warms up and is not counted
            for scenario in SCENARIOS:
                before = rows_created(env)
                measured = run_wrk(base, scenario, args, round_no)
                check_rows(scenario, measured, before, rows_created(env), args)
                if round_no:
                    results[scenario].append(measured)
        bursts = [burst(base, env, args.burst) for _ in range(args.rounds)]
        if args.purge_rows:
            purge_results = measure_during_purge(base, env, args)
    finally:
        server.terminate()
        server.wait(timeout=30)
    report(results, args)
    report_inbox(results)
    report_bursts(bursts, args.burst)
    if args.purge_rows:
        report_purge(purge_results, args)


PURGE = (
    "import django; django.setup(); "
    "from django_idempotency.models import IdempotencyKey; "
    "r = IdempotencyKey.objects.purge_expired(batch_size=10_000, pause=0.05); "
    "print(f'purge: {r.deleted} rows in {r.seconds:.1f} s, longest batch "
    "{r.longest_batch * 1000:.0f} ms', flush=True)"
)


def measure_during_purge(
    base: str, env: dict[str, str], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """Fresh POSTs alone, then while a throttled purge runs, round by round."""
    import psycopg  # noqa: PLC0415

    from benchmarks.purge import FILL_SQL  # noqa: PLC0415

    results: dict[str, list[dict[str, float]]] = {"alone": [], "during purge": []}
    for round_no in range(1, args.rounds + 1):
        with psycopg.connect(env["DATABASE_URL"], autocommit=True) as connection:
            connection.execute(FILL_SQL, [args.purge_rows])
            connection.execute("VACUUM ANALYZE django_idempotency_idempotencykey")
        results["alone"].append(run_wrk(base, "fresh", args, 100 + round_no))
        purge = subprocess.Popen([sys.executable, "-c", PURGE], env=env, cwd=ROOT)
        results["during purge"].append(run_wrk(base, "fresh", args, 200 + round_no))
        purge.wait(timeout=600)
    return results


def report_purge(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    median = {
        name: {metric: statistics.median(r[metric] for r in runs) for metric in runs[0]}
        for name, runs in results.items()
    }
    alone = median["alone"]
    print(f"\nfresh POSTs while a throttled purge deletes {args.purge_rows} expired keys\n")
    print(f"{'':<13} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p99 vs alone':>13}")
    for name, row in median.items():
        ratio = row["p99"] / alone["p99"]
        print(f"{name:<13} {row['rps']:>9.0f} {row['p50']:>8.2f} {row['p99']:>8.2f} {ratio:>13.2f}")


def medians(results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        name: {metric: statistics.median(r[metric] for r in runs) for metric in runs[0]}
        for name, runs in results.items()
    }


def burst(base: str, env: dict[str, str], size: int) -> dict[str, Any]:
    """Send ``size`` identical POSTs with one key at once; count answers and effects."""
    import psycopg  # noqa: PLC0415

    key = f"burst-{time.time_ns()}"
    barrier = threading.Barrier(size)

    def send(_: int) -> str:
        request = urllib.request.Request(  # noqa: S310 - loopback only
            base + SCENARIOS["fresh"]["path"],
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
    with psycopg.connect(env["DATABASE_URL"], autocommit=True) as connection:
        before = connection.execute(count).fetchone()[0]  # type: ignore[index]
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(size) as pool:
            answers = list(pool.map(send, range(size)))
        seconds = time.monotonic() - started
        effects = connection.execute(count).fetchone()[0] - before  # type: ignore[index]
    return {"answers": collections.Counter(answers), "effects": effects, "seconds": seconds}


def report_bursts(bursts: list[dict[str, Any]], size: int) -> None:
    print(f"\n{size} requests with one key at once, {len(bursts)} times\n")
    print(f"{'effects':>7} {'last answer s':>13}  answers")
    for result in bursts:
        answers = ", ".join(f"{n} x {answer}" for answer, n in result["answers"].most_common())
        print(f"{result['effects']:>7} {result['seconds']:>13.2f}  {answers}")
    if any(result["effects"] != 1 for result in bursts):
        raise SystemExit("a burst did not have exactly one effect")
    if any(answer.startswith("5") for result in bursts for answer in result["answers"]):
        raise SystemExit("a burst got a 5xx answer")


def report_inbox(results: dict[str, list[dict[str, float]]]) -> None:
    median = medians(results)
    bare = median["bare-webhook"]
    print("\nwebhooks, each event delivered twice (50% duplicates)\n")
    print(f"{'scenario':<13} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'req/s vs bare':>14}")
    for name in WEBHOOK_SCENARIOS:
        row = median[name]
        ratio = row["rps"] / bare["rps"]
        print(f"{name:<13} {row['rps']:>9.0f} {row['p50']:>8.2f} {row['p99']:>8.2f} {ratio:>14.2f}")


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    median = {name: row for name, row in medians(results).items() if name not in WEBHOOK_SCENARIOS}
    bare = median["bare"]
    print(
        f"\n{args.rounds} rounds x {args.duration} s, {args.connections} connections, "
        f"{args.workers} gunicorn workers; medians of the rounds\n"
    )
    print(f"{'scenario':<8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'req/s vs bare':>14}")
    for name, row in median.items():
        ratio = row["rps"] / bare["rps"]
        print(f"{name:<8} {row['rps']:>9.0f} {row['p50']:>8.2f} {row['p99']:>8.2f} {ratio:>14.2f}")


if __name__ == "__main__":
    main()
