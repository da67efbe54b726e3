#!/usr/bin/env python
"""Outbox relay throughput on PostgreSQL: messages per second, with one relay and with three.

Fills the outbox with N pending messages, then times relays (separate processes) until every
message is dispatched. Two dispatchers:
  noop     does nothing: what the relay itself costs (claim, lease, mark)
  webhook  the WebhookDispatcher, signing each message and POSTing it to a loopback server
           that answers 204 at once

Usage: python benchmarks/outbox.py [--messages N] [--relays 1 3] [--batch-size N]
(PGHOST/PGPORT/PGUSER as usual)
"""

from __future__ import annotations

import argparse
import http.server
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "idempotency_bench_outbox"

FILL_SQL = (
    "INSERT INTO django_idempotency_outboxmessage (message_id, topic, payload, headers, "
    "ordering_key, status, attempts, created_at, next_attempt_at, last_error) "
    "SELECT gen_random_uuid(), %s, jsonb_build_object('payment', n, 'amount', 1250), '{}', '', "
    "'pending', 0, now(), now(), '' FROM generate_series(1, %s) AS n"
)


def setup_django() -> None:
    sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["TEST_DATABASE"] = "postgresql"
    os.environ["TEST_PG_NAME"] = DATABASE
    import django  # noqa: PLC0415

    django.setup()


def run_relay(dispatcher: str, url: str, batch_size: int, ready: object, go: object) -> None:
    """One relay process: register the dispatcher, wait for the start, relay until done."""
    setup_django()
    from django_idempotency.outbox import WebhookDispatcher, register_dispatcher, relay  # noqa: PLC0415

    if dispatcher == "noop":
        register_dispatcher("bench.noop", lambda message: None)
    else:
        register_dispatcher("bench.webhook", WebhookDispatcher(url, ["whsec_YmVuY2htYXJr"]))
    ready.release()  # type: ignore[attr-defined]
    go.wait()  # type: ignore[attr-defined]
    relay(batch_size=batch_size)


class Receiver(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the dispatcher reuses its connection

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def measure(args: argparse.Namespace, dispatcher: str, relays: int, url: str) -> float:
    import psycopg  # noqa: PLC0415
    from django.db import connection  # noqa: PLC0415

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_idempotency_outboxmessage")
        cursor.execute(FILL_SQL, [f"bench.{dispatcher}", args.messages])
        cursor.execute("VACUUM ANALYZE django_idempotency_outboxmessage")
    connection.close()
    context = multiprocessing.get_context("spawn")
    ready, go = context.Semaphore(0), context.Event()
    processes = [
        context.Process(target=run_relay, args=(dispatcher, url, args.batch_size, ready, go))
        for _ in range(relays)
    ]
    for process in processes:
        process.start()
    for _ in processes:
        ready.acquire()
    started = time.monotonic()
    go.set()
    for process in processes:
        process.join()
    seconds = time.monotonic() - started
    with psycopg.connect(dbname=DATABASE, **server_params()) as check:
        left = check.execute(
            "SELECT count(*) FROM django_idempotency_outboxmessage WHERE status <> 'dispatched'"
        ).fetchone()
    if left and left[0]:
        raise SystemExit(f"{left[0]} messages were not dispatched")
    return args.messages / seconds


def server_params() -> dict[str, str]:
    return {
        "host": os.environ.get("PGHOST", "127.0.0.1"),
        "port": os.environ.get("PGPORT", "5432"),
        "user": os.environ.get("PGUSER", "postgres"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--relays", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--dispatchers", nargs="+", default=["noop", "webhook"])
    args = parser.parse_args()

    import psycopg  # noqa: PLC0415

    with psycopg.connect(**server_params(), dbname="postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DATABASE}")
    setup_django()
    from django.core.management import call_command  # noqa: PLC0415

    call_command("migrate", "django_idempotency", verbosity=0)

    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook/"

    print(f"{args.messages:,} pending messages, batches of {args.batch_size}\n")
    print(f"{'dispatcher':<10} {'relays':>6} {'messages/s':>11}")
    for dispatcher in args.dispatchers:
        for relays in args.relays:
            rate = measure(args, dispatcher, relays, url)
            print(f"{dispatcher:<10} {relays:>6} {rate:>11,.0f}", flush=True)
    receiver.shutdown()


if __name__ == "__main__":
    main()
