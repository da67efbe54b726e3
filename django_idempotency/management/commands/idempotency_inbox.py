"""``manage.py idempotency_inbox``: run the inbox's periodic work, or with ``--forever`` be a
worker of the "database" runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connections

from django_idempotency.inbox.processing import dispatch_due
from django_idempotency.inbox.worker import inbox_worker
from django_idempotency.management.queue_command import QueueCommand
from django_idempotency.models import InboxEvent

if TYPE_CHECKING:
    from django.core.management.base import CommandParser

    from django_idempotency.queue.worker import Worker


class Command(QueueCommand):
    help = (
        "Dispatch inbox events whose retry is due or whose dispatch was lost, then delete "
        "processed events older than INBOX_RETENTION. With --forever, keep processing due "
        "events in this process until SIGTERM or SIGINT: the worker of INBOX_RUNNER 'database'."
    )
    jobs = "events"
    batch_size_help = "With --forever: events per batch."
    interval_help = (
        "With --forever: seconds to wait when nothing is due. On PostgreSQL a newly recorded "
        "event ends the wait at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--limit", type=int, default=500, help="Without --forever: dispatch at most this many."
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

    def run_once(self, options: dict[str, Any]) -> None:
        dispatched = dispatch_due(limit=options["limit"])
        self.stdout.write(f"Dispatched {dispatched} due inbox events.")

    def worker(self, options: dict[str, Any]) -> Worker[int]:
        return inbox_worker(
            batch_size=options["batch_size"], listen_using=options["listen_database"]
        )

    def report(self, result: int) -> None:
        if result:
            self.stdout.write(f"Processed {result} inbox events.")

    def purge(self) -> None:
        purged = InboxEvent.objects.purge_processed()
        self.stdout.write(f"Purged {purged} processed inbox events.")
