"""The "database" runner's worker: it takes due inbox events from the table and processes them,
in the retry queue's worker loop (``queue.worker``).

Between batches it waits: on PostgreSQL for a notification on ``CHANNEL`` (sent as an event's
recording commits) or the end of the interval, elsewhere for the interval alone.
"""

from __future__ import annotations

import logging

from django.db import router

from django_idempotency.inbox.processing import CHANNEL, process_due
from django_idempotency.models import InboxEvent
from django_idempotency.queue.worker import Worker

logger = logging.getLogger("django_idempotency.inbox")


def inbox_worker(*, batch_size: int = 50, listen_using: str | None = None) -> Worker[int]:
    """The worker that processes up to ``batch_size`` due events a step; each step returns how
    many it took.

    On PostgreSQL it listens on the ``listen_using`` database (default: the inbox's own), a
    direct connection when the inbox's goes through a pooler.
    """
    return Worker(
        "the inbox worker",
        logger,
        lambda stop: process_due(limit=batch_size, stop=stop),
        # A full batch: more events may be due at once.
        more=lambda taken: taken >= batch_size,
        listen_using=listen_using or router.db_for_write(InboxEvent),
        channel=CHANNEL,
        jobs="events",
    )
