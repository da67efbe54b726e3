"""The models' managers: what the tables do in bulk, purge what is done with and sweep expired
leases.

``IdempotencyKey.objects.purge_expired()`` and the others are what the management commands,
the Celery tasks and the admin call. They work on the model they manage, so the models import
this module and nothing here imports the models; they import only the batched purge and the
sweeper they hand the model to.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, TypeVar

from django.db import models, router
from django.utils import timezone

from django_idempotency.conf import idempotency_settings
from django_idempotency.core import sweeper
from django_idempotency.core.purging import Done, PurgeResult, delete_in_batches

if TYPE_CHECKING:
    from datetime import datetime

    from django_idempotency.reconcile import SweepResult

logger = logging.getLogger("django_idempotency")

M = TypeVar("M", bound=models.Model)


class IdempotencyKeyManager(models.Manager[M]):
    def purge_expired(
        self,
        *,
        now: datetime | None = None,
        batch_size: int = 1_000,
        pause: float | None = None,
        max_seconds: float | None = None,
    ) -> PurgeResult:
        """Delete keys past their expiry, ``batch_size`` ids at a time, each batch committed alone.

        Walks the primary key from the oldest expired key to the newest at the start, so each
        batch is a short range delete that holds its locks only until it commits; call it
        outside a transaction. After each batch the run sleeps ``pause`` seconds, by default as
        long as the batch took, leaving the traffic at least half of the database's time;
        ``max_seconds`` bounds it (the next run carries on). Safe in several processes at once.
        """
        expired = Done("expires_at", "<=", now or timezone.now())
        return delete_in_batches(
            self.model, expired, batch_size=batch_size, pause=pause, max_seconds=max_seconds
        )

    def sweep_expired_leases(self, *, now: datetime | None = None, batch_size: int = 1_000) -> int:
        """Settle keys whose lease ran out, in batches; return how many were settled.

        A request that died (a killed worker) leaves its key in progress until its lease runs
        out; then the next request with the key takes it over anyway. Sweeping does it ahead
        of time, and fences the dead request: it raises the lease version, so a worker that
        was only slow can no longer store its result. Safe in several processes at once: a
        lease is swept once.

        With a ``RECONCILE`` hook (the setting, or a view's own), the hook is asked about each
        key first: its answer is stored, or the key released, or left for a person (see
        ``django_idempotency.reconcile``). Settled means stored or released.
        """
        return self.settle_expired_leases(now=now, batch_size=batch_size).settled

    def settle_expired_leases(
        self, *, now: datetime | None = None, batch_size: int = 1_000
    ) -> SweepResult:
        """``sweep_expired_leases()``, telling what became of each key it found."""
        now = now or timezone.now()
        result = sweeper.sweep(self.model, router.db_for_write(self.model), now, batch_size)
        logger.info(
            "swept %d expired idempotency leases (%d released, %d reconciled, %d unknown, "
            "%d hook errors)",
            result.settled,
            result.released,
            result.reconciled,
            result.unknown,
            result.errors,
            extra={"idempotency_swept": result.settled},
        )
        return result


class InboxEventQuerySet(models.QuerySet[M]):
    def purge_processed(
        self,
        *,
        older_than: datetime | None = None,
        batch_size: int = 1_000,
        max_seconds: float | None = None,
    ) -> int:
        """Delete events processed before ``older_than``, in batches; return how many.

        ``older_than`` defaults to ``INBOX_RETENTION`` ago. Each batch is a transaction of its
        own; call it outside one. Only processed events are deleted: a failed or dead event
        stays until a person deals with it. Safe in several processes at once.
        """
        if older_than is None:
            older_than = timezone.now() - idempotency_settings.INBOX_RETENTION
        processed = Done("processed_at", "<", older_than, status=("status", "processed"))
        return delete_in_batches(
            self.model, processed, batch_size=batch_size, max_seconds=max_seconds
        ).deleted


class OutboxMessageQuerySet(models.QuerySet[M]):
    def purge_dispatched(
        self,
        *,
        older_than: datetime | None = None,
        batch_size: int = 1_000,
        max_seconds: float | None = None,
    ) -> int:
        """Delete messages dispatched before ``older_than``, in batches; return how many.

        ``older_than`` defaults to ``OUTBOX_RETENTION`` ago. Only dispatched messages are
        deleted: a message that was never sent stays, however old. Call it outside a
        transaction. Safe in several processes at once.
        """
        if older_than is None:
            older_than = timezone.now() - idempotency_settings.OUTBOX_RETENTION
        dispatched = Done("dispatched_at", "<", older_than, status=("status", "dispatched"))
        return delete_in_batches(
            self.model, dispatched, batch_size=batch_size, max_seconds=max_seconds
        ).deleted
