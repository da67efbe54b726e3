"""``manage.py idempotency_purge``: delete expired keys, for cron users without Celery."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_idempotency.models import IdempotencyKey


class Command(BaseCommand):
    help = "Delete idempotency keys past their expiry, in short batches."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size", type=int, default=1_000, help="ids per batch (default 1000)"
        )
        parser.add_argument(
            "--pause",
            type=float,
            default=None,
            help="seconds to sleep after each batch (default: as long as the batch took)",
        )
        parser.add_argument(
            "--max-seconds", type=float, default=None, help="stop after this long; rerun later"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["batch_size"] < 1:
            self.stderr.write("--batch-size must be at least 1.")
            raise SystemExit(2)
        result = IdempotencyKey.objects.purge_expired(
            batch_size=options["batch_size"],
            pause=options["pause"],
            max_seconds=options["max_seconds"],
        )
        self.stdout.write(
            f"Deleted {result.deleted} expired keys in {result.batches} batches "
            f"({result.seconds:.2f} s)"
            + ("." if result.complete else "; stopped at --max-seconds, run again to go on.")
        )
