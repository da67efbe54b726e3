#!/usr/bin/env python
"""Outbox relay throughput on PostgreSQL: messages per second, with one relay and with three.

Fills the outbox with N pending messages, then times relays (separate processes) until every
message is dispatched, and prints the rates as a Markdown table. The dispatchers:
  noop       does nothing: what the relay itself costs (claim, lease, mark)
  webhook    the WebhookDispatcher, signing each message and POSTing it to a loopback server
             that answers 204 at once
  broker     the BrokerDispatcher, publishing to RabbitMQ with publisher confirms
  unconfirmed  the same without confirms

Usage: python benchmarks/outbox.py [--messages N] [--relays 1 3] [--batch-size N]
(PGHOST/PGPORT/PGUSER as usual; RabbitMQ at BENCH_AMQP_URL, default the local one)
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

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import drop_database, dsn, recreate_database, setup_django, table

DATABASE = "idempotency_bench_outbox"

FILL_SQL = (
    "INSERT INTO django_idempotency_outboxmessage (message_id, topic, payload, headers, "
    "ordering_key, status, attempts, created_at, next_attempt_at, last_error) "
    "SELECT gen_random_uuid(), %s, jsonb_build_object('payment', n, 'amount', 1250), '{}', '', "
    "'pending', 0, now(), now(), '' FROM generate_series(1, %s) AS n"
)


# How the tables name the dispatchers.
DISPATCHERS = {
    "noop": "none (the relay's own cost: claim, lease, mark)",
    "webhook": "`WebhookDispatcher` to a loopback server that answers 204",
    "broker": "`BrokerDispatcher` to RabbitMQ, with publisher confirms",
    "unconfirmed": "`BrokerDispatcher` to RabbitMQ, without confirms",
}
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
# The exchange the broker dispatchers publish to, and the queue bound to it that keeps them.
EXCHANGE, QUEUE = "idempotency-bench-outbox", "idempotency-bench-outbox"


def run_relay(dispatcher: str, url: str, batch_size: int, ready: object, go: object) -> None:
    """One relay process: register the dispatcher, wait for the start, relay until done."""
    setup_django(DATABASE)
    from django_idempotency.outbox import WebhookDispatcher, register_dispatcher, relay  # noqa: PLC0415

    if dispatcher == "noop":
        register_dispatcher("bench.noop", lambda message: None)
    elif dispatcher == "webhook":
        register_dispatcher("bench.webhook", WebhookDispatcher(url, ["whsec_YmVuY2htYXJr"]))
    else:
        from django_idempotency.brokers import BrokerDispatcher  # noqa: PLC0415

        confirm = dispatcher == "broker"
        register_dispatcher(
            f"bench.{dispatcher}", BrokerDispatcher(AMQP_URL, EXCHANGE, confirm=confirm)
        )
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


def measure_one(args: argparse.Namespace, dispatcher: str, relays: int, url: str) -> float:
    """Messages per second of ``relays`` relays with ``dispatcher``, from a full outbox."""
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
        if not ready.acquire(timeout=120):
            for process in processes:
                process.terminate()
            raise SystemExit("a relay process did not start")
    started = time.monotonic()
    go.set()
    for process in processes:
        process.join()
    seconds = time.monotonic() - started
    if any(process.exitcode for process in processes):
        raise SystemExit("a relay process failed")
    with psycopg.connect(dsn(DATABASE)) as check:
        left = check.execute(
            "SELECT count(*) FROM django_idempotency_outboxmessage WHERE status <> 'dispatched'"
        ).fetchone()
    if left and left[0]:
        raise SystemExit(f"{left[0]} messages were not dispatched")
    return float(args.messages / seconds)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--relays", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--dispatchers", nargs="+", choices=DISPATCHERS, default=list(DISPATCHERS))
    return parser.parse_args(argv)


def broker_queue(action: str) -> None:
    """Declare the benchmark's queue, bound to its exchange, or delete both."""
    from kombu import Connection, Exchange, Queue  # noqa: PLC0415

    exchange = Exchange(EXCHANGE, type="topic", durable=True)
    with Connection(AMQP_URL) as connection:
        queue = Queue(QUEUE, exchange, routing_key="#", durable=True)(connection.default_channel)
        if action == "declare":
            queue.declare()
        else:
            queue.delete()
            exchange(connection.default_channel).delete()


def measure(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """Messages per second of each dispatcher with each number of relays."""
    brokers = {"broker", "unconfirmed"} & set(args.dispatchers)
    if brokers:
        broker_queue("declare")
    recreate_database(DATABASE)
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook/"
    try:
        setup_django(DATABASE)
        from django.core.management import call_command  # noqa: PLC0415

        call_command("migrate", "django_idempotency", verbosity=0)
        return {
            dispatcher: {
                relays: measure_one(args, dispatcher, relays, url) for relays in args.relays
            }
            for dispatcher in args.dispatchers
        }
    finally:
        receiver.shutdown()
        drop_database(DATABASE)
        if brokers:
            broker_queue("delete")


def report(rates: dict[str, dict[int, float]], args: argparse.Namespace) -> str:
    header = ["dispatcher"] + [f"{n} relay{'s' if n > 1 else ''}" for n in args.relays]
    rows = [
        [DISPATCHERS[dispatcher]] + [f"{rate:,.0f} messages/s" for rate in by_relays.values()]
        for dispatcher, by_relays in rates.items()
    ]
    return "\n\n".join(
        [
            f"Relays in separate processes, from {args.messages:,} pending messages until all "
            f"are dispatched, batches of {args.batch_size}:",
            table(header, rows),
        ]
    )


def main() -> None:
    args = parse_arguments()
    print(report(measure(args), args))


if __name__ == "__main__":
    main()
