#!/usr/bin/env python
"""Every benchmark in one run: each figure of docs/benchmarks.md, and the concurrency plot.

Runs these one after the other, each in a process of its own:
  run.py     the example under gunicorn on PostgreSQL, driven by wrk: fresh and replay against
             a bare view, beside a naive idempotent view's (the floor), the inbox against a bare
             webhook view, bursts of one key, bare, fresh
             and replay at each number of connections of --sweep (plotted into --plot), and
             fresh POSTs alone and during a purge of --keys expired keys
  purge.py   purge_expired() against one unbatched DELETE of --keys expired keys
  admin.py   the admin's pages at --keys keys
  outbox.py  the outbox relay's throughput
  profiling.py  where a keyed request's and a webhook's time goes, in one process: in the
             example, then in the minimal project
  minimal    the minimal project (benchmarks/minimal) under gunicorn's gthread workers: each
             idempotent scenario against the same bare viewset and against its naive floor
then run.py's requests, webhooks and bursts once more under gunicorn's gthread workers (4 x 4
threads; --worker-classes sync leaves them out), and, with --databases postgresql mariadb, on
MariaDB too, then
  asgi_requests.py  the example's async view, fresh and replay, against the same bare async
             view under uvicorn (--asgi-workers workers; --asgi-workers 0 leaves it out),
then prints the machine, the command and every table in Markdown, headed as in
docs/benchmarks.md. Progress goes to stderr, so `... > results.md` keeps the tables alone. Each
part drops its database when it is done.

Needs wrk, a PostgreSQL server (PGHOST/PGPORT/PGUSER, default 127.0.0.1:5432/postgres), Redis
on 127.0.0.1:6379 and the bench extra; for MariaDB, a MariaDB server (MARIADB_HOST, MARIADB_PORT,
MARIADB_USER, MARIADB_PASSWORD, default 127.0.0.1:3306/root) and the mariadb extra. --quick
runs every part at a tiny size, in a few minutes: a smoke test, whose figures mean nothing.
Usage: python benchmarks/all.py [--quick] [--databases D ...] [--rounds N] [--duration S] ...
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import admin, asgi_requests, outbox, profiling, purge, run, tables
from benchmarks.common import ROOT, drop_database
from benchmarks.databases import DATABASES
from benchmarks.minimal import bench as minimal

if TYPE_CHECKING:
    from collections.abc import Callable
    from multiprocessing.connection import Connection

T = TypeVar("T")

PLOT = Path("docs/images/benchmark-concurrency.png")  # from the project's root

# What a full run measures where the scripts' own defaults do not say.
FULL: dict[str, Any] = {"sweep": [1, 2, 4, 8, 16, 32], "keys": 1_000_000}
# --quick: every part, tiny.
QUICK: dict[str, Any] = {
    "duration": 1,
    "rounds": 1,
    "burst": 16,
    "sweep": [1, 4],
    "sweep_duration": 1,
    "keys": 20_000,
    "loads": 1,
    "messages": 2_000,
    "relays": [1, 2],
    "profile_requests": 20,
}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of every part, tiny")
    parser.add_argument(
        "--databases",
        nargs="+",
        choices=list(DATABASES),
        default=["postgresql"],
        metavar="D",
        help="servers for the requests: postgresql (every part), and mariadb (requests, "
        "webhooks and bursts) beside it (postgresql)",
    )
    requests = parser.add_argument_group("requests (run.py; its defaults unless --quick)")
    requests.add_argument("--duration", type=int, help="seconds per scenario and round (10)")
    requests.add_argument("--rounds", type=int, help="rounds, after a warm-up round (3)")
    requests.add_argument("--connections", type=int, help="wrk connections (8)")
    requests.add_argument("--threads", type=int, help="wrk threads (2)")
    requests.add_argument("--workers", type=int, help="gunicorn sync workers (2)")
    requests.add_argument(
        "--worker-classes",
        nargs="+",
        choices=["sync", "gthread"],
        default=["sync", "gthread"],
        metavar="C",
        help="gunicorn worker classes: sync (every request part), and gthread (requests, "
        "webhooks and bursts, 4 workers x 4 threads) beside it (sync gthread)",
    )
    requests.add_argument("--port", type=int, help="gunicorn's port on 127.0.0.1 (8765)")
    requests.add_argument(
        "--asgi-workers",
        type=int,
        default=2,
        metavar="N",
        help="uvicorn workers for the async view's requests (2); 0 leaves them out",
    )
    requests.add_argument("--burst", type=int, help="same-key requests sent at once (64)")
    requests.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        metavar="N",
        help="numbers of connections for the plot (1 2 4 8 16 32); none: no sweep, no plot",
    )
    requests.add_argument(
        "--sweep-duration", type=int, help="seconds per scenario, level and round (5)"
    )
    requests.add_argument(
        "--plot",
        type=Path,
        help=f"the plot's PNG ({PLOT}; with --quick, one in the temporary directory)",
    )
    sizes = parser.add_argument_group("the other parts")
    sizes.add_argument(
        "--keys", type=int, help="expired keys to purge, keys in the admin (1,000,000)"
    )
    sizes.add_argument("--loads", type=int, help="loads of each admin page (5)")
    sizes.add_argument("--messages", type=int, help="pending outbox messages (100,000)")
    sizes.add_argument("--relays", type=int, nargs="+", help="numbers of relays (1 3)")
    sizes.add_argument(
        "--profile-requests", type=int, help="requests of each scenario profiled (500)"
    )
    args = parser.parse_args()
    if "postgresql" not in args.databases:
        parser.error("every part runs on PostgreSQL: --databases adds MariaDB beside it")
    if "sync" not in args.worker_classes:
        parser.error("every request part runs on sync workers: --worker-classes adds gthread")
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.plot is None:
        args.plot = Path(tempfile.gettempdir()) / PLOT.name if args.quick else ROOT / PLOT
    return args


def options(**values: Any) -> list[str]:
    """Command-line options for a script: ``--name value``, or nothing for ``None``."""
    argv: list[str] = []
    for name, value in values.items():
        if value is not None:
            words = value if isinstance(value, list) else [value]
            argv += ["--" + name.replace("_", "-"), *map(str, words)]
    return argv


def _call(sender: Connection, function: Callable[[argparse.Namespace], Any], args: Any) -> None:
    sender.send(function(args))
    sender.close()


def in_own_process(function: Callable[[argparse.Namespace], T], args: argparse.Namespace) -> T:
    """``function(args)`` in a new interpreter: each part sets Django up in its own way."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_call, args=(sender, function, args))
    process.start()
    sender.close()
    try:
        result: T = receiver.recv()
    except EOFError:  # it failed, and said why on stderr
        process.join()
        raise SystemExit(f"{function.__module__} failed (exit code {process.exitcode})") from None
    process.join()
    return result


def machine(databases: list[str]) -> str:
    """The CPU, the servers and the versions, as a Markdown list."""
    import redis  # noqa: PLC0415

    cpu = platform.processor() or platform.machine()
    memory = ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        pass
    else:
        cpu = re.search(r"model name\s*: (.*)", cpuinfo).group(1)  # type: ignore[union-attr]
        kib = int(re.search(r"MemTotal:\s*(\d+) kB", meminfo).group(1))  # type: ignore[union-attr]
        memory = f", {kib / 1024**2:.1f} GiB of memory"
    servers = ", ".join(
        f"{DATABASES[name].title} {DATABASES[name].version()}" for name in databases
    )
    redis_version = redis.Redis().info("server")["redis_version"]
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True, check=False)
    wrk_version = re.search(r"wrk (\S+)", wrk.stdout + wrk.stderr)
    packages = {
        "Django": "django",
        "Django REST framework": "djangorestframework",
        "gunicorn": "gunicorn",
        "uvicorn": "uvicorn",
        "psycopg": "psycopg",
        "Celery": "celery",
    }
    if "mariadb" in databases:
        packages = {**packages, "mysqlclient": "mysqlclient"}
    versions = ", ".join(
        f"{name} {metadata.version(package)}" for name, package in packages.items()
    )
    return "\n".join(
        [
            f"- {cpu}, {multiprocessing.cpu_count()} cores{memory}",
            f"- {platform.system()} {platform.release()}; {servers}, "
            f"Redis {redis_version}, wrk {wrk_version.group(1) if wrk_version else '?'}",
            f"- Python {platform.python_version()}, {versions}",
        ]
    )


def part_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Each part's arguments, by the part's name, from the command line's."""
    parts = argparse.Namespace()
    parts.run = run.parse_arguments(
        options(
            duration=args.duration,
            rounds=args.rounds,
            connections=args.connections,
            threads=args.threads,
            workers=args.workers,
            port=args.port,
            burst=args.burst,
            sweep=args.sweep,
            sweep_duration=args.sweep_duration,
            purge_rows=args.keys,
        )
    )
    parts.purge = purge.parse_arguments(options(rows=args.keys))
    parts.admin = admin.parse_arguments(options(keys=args.keys, loads=args.loads))
    parts.outbox = outbox.parse_arguments(options(messages=args.messages, relays=args.relays))
    parts.profile = profiling.parse_arguments(options(requests=args.profile_requests))
    parts.profile_minimal = argparse.Namespace(**{**vars(parts.profile), "minimal": True})
    # The minimal project's rounds: as run.py's, under its own gthread workers.
    parts.minimal = minimal.parse_arguments(
        options(
            duration=args.duration,
            rounds=args.rounds,
            connections=args.connections,
            threads=args.threads,
            spread_keys=50 if args.quick else None,
        )
    )
    parts.minimal_mariadb = argparse.Namespace(**{**vars(parts.minimal), "database": "mariadb"})
    # The async view's requests under uvicorn: the same rounds as run.py's.
    parts.asgi = asgi_requests.parse_arguments(
        options(
            duration=args.duration,
            rounds=args.rounds,
            connections=args.connections,
            threads=args.threads,
            workers=args.asgi_workers or None,
        )
    )
    # The requests on MariaDB: run.py's rounds and bursts, without the sweep and the purge.
    parts.mariadb = argparse.Namespace(
        **{**vars(parts.run), "database": "mariadb", "sweep": [], "plot": None, "purge_rows": 0}
    )
    # The requests under gthread workers: the same rounds and bursts, on PostgreSQL.
    parts.gthread = argparse.Namespace(
        **{
            **vars(parts.mariadb),
            "database": "postgresql",
            "worker_class": "gthread",
            "workers": 4,
            "worker_threads": 4,
        }
    )
    return parts


def main() -> None:
    args = parse_arguments()
    parts = part_arguments(args)
    run_args, purge_args, admin_args = parts.run, parts.purge, parts.admin
    outbox_args, profile_args, asgi_args = parts.outbox, parts.profile, parts.asgi
    mariadb_args, gthread_args = parts.mariadb, parts.gthread
    progress(
        f"wrk alone will run for {wrk_minutes(args, run_args):.1f} min; the fills and the other "
        "parts add more"
    )

    started = time.monotonic()
    try:
        progress("requests, bursts, sweep, requests during a purge")
        requests = in_own_process(run.measure, run_args)
        if run_args.sweep:
            tables.plot(requests, run_args, args.plot)
        if "gthread" in args.worker_classes:
            progress("requests, bursts under gthread workers")
            threaded = in_own_process(run.measure, gthread_args)
        if "mariadb" in args.databases:
            progress("requests, bursts on MariaDB")
            on_mariadb = in_own_process(run.measure, mariadb_args)
        if args.asgi_workers:
            progress("the async view's requests under uvicorn")
            asynchronous = in_own_process(asgi_requests.measure, asgi_args)
        progress("purge against one DELETE")
        purged = in_own_process(purge.measure, purge_args)
        progress("admin pages")
        pages = in_own_process(admin.measure, admin_args)
        progress("outbox relays")
        relayed = in_own_process(outbox.measure, outbox_args)
        progress("where the time goes, in one process")
        profiled = in_own_process(profiling.measure, profile_args)
        minimal_section = measure_minimal(args, parts)
    finally:  # in case a part died before it could drop its database
        for database in (
            run.DATABASE,
            asgi_requests.DATABASE,
            purge.DATABASE,
            admin.DATABASE,
            outbox.DATABASE,
            profiling.DATABASE,
            minimal.DATABASE,
        ):
            drop_database(database)
        if "mariadb" in args.databases:
            DATABASES["mariadb"].drop(run.DATABASE)
            DATABASES["mariadb"].drop(minimal.DATABASE)
    minutes = (time.monotonic() - started) / 60

    command = shlex.join(["python", "benchmarks/all.py", *sys.argv[1:]])
    today = datetime.datetime.now(datetime.UTC).date()
    sections = [
        f"# Benchmarks\n\n`{command}`, {today}, {minutes:.1f} min.",
        f"## The machine\n\n{machine(args.databases)}",
        "## Requests: idempotent view against the same bare view\n\n"
        + tables.requests_section(requests, run_args),
        "## Webhooks: the inbox against a view that only inserts the row\n\n"
        + tables.webhooks_section(requests, run_args),
        "## A burst of one key\n\n" + tables.bursts_section(requests, run_args),
    ]
    if run_args.sweep:
        sections.append(
            "## Throughput against concurrency\n\n"
            + tables.sweep_section(requests, run_args)
            + f"\n\n![Throughput against concurrency]({image_link(args.plot)})"
        )
    sections += [
        "## The outbox relay\n\n" + outbox.report(relayed, outbox_args),
        f"## The admin at {args.keys:,} keys\n\n" + admin.report(pages, admin_args),
        "## Purging expired keys\n\n" + purge.report(purged, purge_args),
        "### Requests during a purge\n\n" + tables.during_purge_section(requests, run_args),
        "## Where the time goes\n\n" + profiled,
        minimal_section,
    ]
    if "gthread" in args.worker_classes:
        sections.append(gthread_section(threaded, gthread_args))
    if "mariadb" in args.databases:
        sections.append(mariadb_section(on_mariadb, mariadb_args))
    if args.asgi_workers:
        sections.append(
            "## Async views under uvicorn\n\n" + asgi_requests.report(asynchronous, asgi_args)
        )
    print("\n\n".join(sections))


def measure_minimal(args: argparse.Namespace, parts: argparse.Namespace) -> str:
    """The minimal project's part: where its time goes, then its rounds on each database."""
    progress("where the time goes in the minimal project, in one process")
    profiled = in_own_process(profiling.measure, parts.profile_minimal)
    progress("the minimal project")
    sections = [minimal.report(in_own_process(minimal.measure, parts.minimal), parts.minimal)]
    if "mariadb" in args.databases:
        on_mariadb = in_own_process(minimal.measure, parts.minimal_mariadb)
        sections.append(minimal.report(on_mariadb, parts.minimal_mariadb))
    return (
        "## The minimal project\n\n"
        + "\n\n".join(sections)
        + "\n\n### Where the time goes in the minimal project\n\n"
        + profiled
    )


def wrk_minutes(args: argparse.Namespace, run_args: argparse.Namespace) -> float:
    """How long wrk itself runs, all parts together."""
    rounds_load = run_args.duration * (run_args.rounds + 1) * len(run.SCENARIOS)
    load = rounds_load + run_args.duration * run_args.rounds * 2
    load += run_args.sweep_duration * run_args.rounds * len(run_args.sweep) * 3
    load += rounds_load * (len(args.databases) - 1 + len(args.worker_classes) - 1)
    if args.asgi_workers:
        load += run_args.duration * (run_args.rounds + 1) * len(asgi_requests.SCENARIOS)
    # The minimal project's rounds, on each database.
    load += run_args.duration * (run_args.rounds + 1) * len(minimal.SCENARIOS) * len(args.databases)
    return load / 60


def mariadb_section(results: run.Results, args: argparse.Namespace) -> str:
    """run.py's tables from the run on MariaDB, under a heading of their own."""
    return (
        f"## MariaDB\n\nThe same requests on MariaDB {DATABASES['mariadb'].version()}, right "
        "after those on PostgreSQL, with the same example, gunicorn, wrk and Redis.\n\n"
        + tables.report(results, args, level=3)
    )


def gthread_section(results: run.Results, args: argparse.Namespace) -> str:
    """run.py's tables from the run under gthread workers, under a heading of their own."""
    return (
        f"## Threaded workers\n\nThe same requests under {tables.workers_text(args)}, right after "
        "those under sync workers, on the same PostgreSQL, wrk and Redis.\n\n"
        + tables.report(results, args, level=3, suffix=" under gthread workers")
    )


def image_link(path: Path) -> str:
    """How docs/benchmarks.md links the plot: relative to docs/ when the plot is there."""
    path = path.resolve()
    if path.is_relative_to(ROOT / "docs"):
        return path.relative_to(ROOT / "docs").as_posix()
    return path.as_posix()


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
