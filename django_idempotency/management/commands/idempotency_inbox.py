"""``manage.py idempotency_inbox``: run the inbox's periodic work, or with ``--forever`` be a
worker of the "database" runner."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import connections

from django_idempotency.inbox.processing import dispatch_due
from django_idempotency.inbox.worker import run_worker
from django_idempotency.models import InboxEvent

# Running forever, the purge runs this often rather than after every batch.
PURGE_EVERY = 60.0


class Command(BaseCommand):
    help = (
        "Dispatch inbox events whose retry is due or whose dispatch was lost, then delete "
        "processed events older than INBOX_RETENTION. With --forever, keep processing due "
        "events in this process until SIGTERM or SIGINT: the worker of INBOX_RUNNER 'database'."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--limit", type=int, default=500, help="Dispatch at most this many events."
        )
        parser.add_argument("--no-purge", action="store_true", help="Do not delete old events.")
        parser.add_argument(
            "--forever",
            action="store_true",
            help="Keep processing due events, in batches, until stopped.",
        )
        parser.add_argument(
            "--batch-size", type=int, default=50, help="With --forever: events per batch."
        )
        parser.add_argument(
            "--interval",
            type=float,
            default=1.0,
            help=(
                "With --forever: seconds to wait when nothing is due. On PostgreSQL a newly "
                "recorded event ends the wait at once."
            ),
        )
        parser.add_argument(
            "--listen-database",
            choices=list(connections),
            help=(
                "With --forever, on PostgreSQL: the database alias to listen for new events on "
                "(default: the inbox's own). Name one that connects directly when the inbox's "
                "goes through PgBouncer, which does not carry notifications."
            ),
        )

    def handle(
        self,
        *args: Any,
        limit: int,
        no_purge: bool,
        forever: bool,
        batch_size: int,
        interval: float,
        listen_database: str | None,
        **options: Any,
    ) -> None:
        if forever:
            self.work(
                batch_size=batch_size,
                interval=interval,
                purge=not no_purge,
                listen_using=listen_database,
            )
            return
        dispatched = dispatch_due(limit=limit)
        self.stdout.write(f"Dispatched {dispatched} due inbox events.")
        if not no_purge:
            self.purge()

    def work(
        self, *, batch_size: int, interval: float, purge: bool, listen_using: str | None
    ) -> None:
        stop = threading.Event()

        def ask_to_stop(signum: int, frame: object) -> None:
            # The event being processed is finished first; the rest of its batch is left due.
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, ask_to_stop)
        purged_at = time.monotonic() - PURGE_EVERY if purge else None

        def after_batch(taken: int) -> None:
            nonlocal purged_at
            if taken:
                self.stdout.write(f"Processed {taken} inbox events.")
            if purged_at is not None and time.monotonic() - purged_at >= PURGE_EVERY:
                self.purge()
                purged_at = time.monotonic()

        run_worker(
            stop=stop,
            batch_size=batch_size,
            interval=interval,
            after_batch=after_batch,
            listen_using=listen_using,
        )
        self.stdout.write("Stopped.")

    def purge(self) -> None:
        purged = InboxEvent.objects.purge_processed()
        self.stdout.write(f"Purged {purged} processed inbox events.")
