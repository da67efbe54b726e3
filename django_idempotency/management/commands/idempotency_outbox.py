"""``manage.py idempotency_outbox``: relay the outbox, for users without Celery."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django_idempotency.management.queue_command import QueueCommand
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox.relaying import DEFAULT_LEASE, relay, relay_worker

if TYPE_CHECKING:
    from django.core.management.base import CommandParser

    from django_idempotency.outbox.relaying import RelayResult
    from django_idempotency.queue.worker import Worker


class Command(QueueCommand):
    help = (
        "Dispatch the outbox's due messages, then delete dispatched messages older than "
        "OUTBOX_RETENTION. With --forever, keep relaying, every --interval seconds, until "
        "SIGTERM or SIGINT."
    )
    jobs = "messages"

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "--lease",
            type=float,
            default=DEFAULT_LEASE.total_seconds(),
            help="Seconds a batch is ours: a batch not marked by then is sent again.",
        )

    def run_once(self, options: dict[str, Any]) -> None:
        self.say(relay(batch_size=options["batch_size"], lease=_lease(options)))

    def worker(self, options: dict[str, Any]) -> Worker[RelayResult]:
        return relay_worker(batch_size=options["batch_size"], lease=_lease(options))

    def report(self, result: RelayResult) -> None:
        if result.batches:  # running forever, only the runs that sent something
            self.say(result)

    def say(self, result: RelayResult) -> None:
        self.stdout.write(
            f"Dispatched {result.dispatched} outbox messages"
            f" ({result.failed} to retry, {result.dead} dead)."
        )

    def purge(self) -> None:
        purged = OutboxMessage.objects.purge_dispatched()
        self.stdout.write(f"Purged {purged} dispatched outbox messages.")


def _lease(options: dict[str, Any]) -> timedelta:
    return timedelta(seconds=options["lease"])
