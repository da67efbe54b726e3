"""What the inbox's and the outbox's commands share: one run of their periodic work, or with
``--forever`` the retry queue's worker loop until SIGTERM or SIGINT, purging once a minute."""

from __future__ import annotations

import signal
import threading
import time
from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Any

from django.core.management.base import BaseCommand

from django_idempotency.queue.worker import run_worker

if TYPE_CHECKING:
    from django.core.management.base import CommandParser

    from django_idempotency.queue.worker import Worker

#: Running forever, the purge runs this often rather than after every batch.
PURGE_EVERY = 60.0


class QueueCommand(BaseCommand, metaclass=ABCMeta):
    """A command over a table of the retry queue: :meth:`run_once`, or its :meth:`worker`."""

    #: What the command takes from its table, as its options' help names them.
    jobs = "jobs"
    batch_size_help = ""  # default: "<Jobs> per batch."
    interval_help = "With --forever: seconds to wait when nothing is due."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--forever",
            action="store_true",
            help=f"Keep taking due {self.jobs}, in batches, until SIGTERM or SIGINT.",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=50,
            help=self.batch_size_help or f"{self.jobs.capitalize()} per batch.",
        )
        parser.add_argument("--interval", type=float, default=1.0, help=self.interval_help)
        parser.add_argument(
            "--no-purge", action="store_true", help=f"Do not delete old {self.jobs}."
        )

    def handle(
        self, *args: Any, forever: bool, interval: float, no_purge: bool, **options: Any
    ) -> None:
        if not forever:
            self.run_once(options)
            if not no_purge:
                self.purge()
            return
        stop = threading.Event()

        def ask_to_stop(signum: int, frame: object) -> None:
            # The job being run is finished first; the rest of its batch is left due.
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, ask_to_stop)
        purged_at = None if no_purge else time.monotonic() - PURGE_EVERY

        def report(result: Any) -> None:
            nonlocal purged_at
            self.report(result)
            if purged_at is not None and time.monotonic() - purged_at >= PURGE_EVERY:
                self.purge()
                purged_at = time.monotonic()

        run_worker(self.worker(options), stop=stop, interval=interval, report=report)
        self.stdout.write("Stopped.")

    @abstractmethod
    def run_once(self, options: dict[str, Any]) -> None:
        """Take what is due once, and say what was done."""

    @abstractmethod
    def worker(self, options: dict[str, Any]) -> Worker[Any]:
        """The worker that ``--forever`` runs."""

    @abstractmethod
    def report(self, result: Any) -> None:
        """Say what a step of the worker did, if anything."""

    @abstractmethod
    def purge(self) -> None:
        """Delete the old jobs that are done, and say how many."""
