"""``manage.py idempotency_outbox``: relay the outbox, for users without Celery."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import close_old_connections

from django_idempotency.models import OutboxMessage
from django_idempotency.outbox.relaying import DEFAULT_LEASE, relay


class Command(BaseCommand):
    help = (
        "Dispatch the outbox's due messages, then delete dispatched messages older than "
        "OUTBOX_RETENTION. With --forever, keep relaying."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=50, help="Messages per batch.")
        parser.add_argument(
            "--forever",
            action="store_true",
            help="Keep relaying, every --interval seconds, until stopped.",
        )
        parser.add_argument(
            "--interval", type=float, default=1.0, help="With --forever: seconds between runs."
        )
        parser.add_argument(
            "--lease",
            type=float,
            default=DEFAULT_LEASE.total_seconds(),
            help="Seconds a batch is ours: a batch not marked by then is sent again.",
        )
        parser.add_argument("--no-purge", action="store_true", help="Do not delete old messages.")

    def handle(
        self,
        *args: Any,
        batch_size: int,
        forever: bool,
        interval: float,
        lease: float,
        no_purge: bool,
        **options: Any,
    ) -> None:
        purged_at = None
        while True:
            result = relay(batch_size=batch_size, lease=timedelta(seconds=lease))
            if result.batches or not forever:
                self.stdout.write(
                    f"Dispatched {result.dispatched} outbox messages"
                    f" ({result.failed} to retry, {result.dead} dead)."
                )
            # Running forever, purge once a minute rather than at every run.
            if not no_purge and (purged_at is None or time.monotonic() - purged_at >= 60):
                purged = OutboxMessage.objects.purge_dispatched()
                purged_at = time.monotonic()
                self.stdout.write(f"Purged {purged} dispatched outbox messages.")
            if not forever:
                return
            close_old_connections()
            time.sleep(interval)
