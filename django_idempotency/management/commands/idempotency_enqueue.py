"""``manage.py idempotency_enqueue``: enqueue one of the package's periodic tasks on Django's
Tasks framework, for a cron line to run through the project's task worker."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.core.management.base import BaseCommand, CommandError

if TYPE_CHECKING:
    from django.core.management.base import CommandParser

# The tasks of django_idempotency.django_tasks.lifecycle.
TASKS = (
    "purge_expired_keys",
    "sweep_expired_leases",
    "dispatch_due_inbox_events",
    "purge_processed_inbox_events",
    "relay_outbox",
    "purge_dispatched_outbox_messages",
)


class Command(BaseCommand):
    help = (
        "Enqueue one of the package's periodic tasks on Django's Tasks framework, for the "
        "project's task worker to run."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("task", choices=TASKS)
        parser.add_argument(
            "--kwargs", default="{}", help='the task\'s keyword arguments, as JSON: {"limit": 100}'
        )
        parser.add_argument("--backend", help="the task backend's alias (default: the task's)")
        parser.add_argument("--queue-name", help="the queue (default: the task's)")

    def handle(self, *args: Any, **options: Any) -> None:
        # The framework is optional: only this command's run needs it.
        from django_idempotency.django_tasks import lifecycle  # noqa: PLC0415

        try:
            kwargs = json.loads(options["kwargs"])
        except ValueError as exc:
            msg = f"--kwargs is not JSON: {exc}"
            raise CommandError(msg) from exc
        if not isinstance(kwargs, dict):
            msg = "--kwargs must be a JSON object"
            raise CommandError(msg)
        task = getattr(lifecycle, options["task"]).using(
            backend=options["backend"], queue_name=options["queue_name"]
        )
        result = task.enqueue(**kwargs)
        self.stdout.write(f"Enqueued {options['task']} as the task result {result.id}.")
