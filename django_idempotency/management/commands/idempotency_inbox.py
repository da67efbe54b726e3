"""``manage.py idempotency_inbox``: run the inbox's periodic work, for cron users."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_idempotency.inbox.processing import dispatch_due
from django_idempotency.models import InboxEvent


class Command(BaseCommand):
    help = (
        "Dispatch inbox events whose retry is due or whose dispatch was lost, then delete "
        "processed events older than INBOX_RETENTION."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--limit", type=int, default=500, help="Dispatch at most this many events."
        )
        parser.add_argument("--no-purge", action="store_true", help="Do not delete old events.")

    def handle(self, *args: Any, limit: int, no_purge: bool, **options: Any) -> None:
        dispatched = dispatch_due(limit=limit)
        self.stdout.write(f"Dispatched {dispatched} due inbox events.")
        if not no_purge:
            purged = InboxEvent.objects.purge_processed()
            self.stdout.write(f"Purged {purged} processed inbox events.")
