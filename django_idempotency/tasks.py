"""Celery tasks: schedule them with Celery beat. They are declared through ``core.task_sending``.

Every task is safe to run on several workers at once and when beat fires twice.
"""

from __future__ import annotations

from django_idempotency.core.task_sending import task
from django_idempotency.inbox.processing import dispatch_due, process
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from django_idempotency.outbox.relaying import relay

__all__ = [
    "dispatch_due_inbox_events",
    "process_inbox_event",
    "purge_dispatched_outbox_messages",
    "purge_expired_keys",
    "purge_processed_inbox_events",
    "relay_outbox",
    "sweep_expired_leases",
]


@task("django_idempotency.purge_expired_keys")
def purge_expired_keys(
    batch_size: int = 1_000, pause: float | None = None, max_seconds: float | None = 240.0
) -> int:
    """Delete keys past their expiry; return how many were deleted."""
    result = IdempotencyKey.objects.purge_expired(
        batch_size=batch_size, pause=pause, max_seconds=max_seconds
    )
    return result.deleted


@task("django_idempotency.sweep_expired_leases")
def sweep_expired_leases() -> int:
    """Settle keys whose lease ran out (asking the RECONCILE hook, if any); return how many."""
    return IdempotencyKey.objects.sweep_expired_leases()


# acks_late: a message is acknowledged once the attempt ends, so a worker that dies mid-attempt
# leaves it to be delivered again; the attempt was counted, and the claim makes a second
# delivery of a live or finished attempt a no-op.
@task("django_idempotency.process_inbox_event", acks_late=True, reject_on_worker_lost=True)
def process_inbox_event(event_pk: int) -> str:
    """Attempt to process one inbox event; return the outcome."""
    return process(event_pk).value


@task("django_idempotency.dispatch_due_inbox_events")
def dispatch_due_inbox_events(limit: int = 500) -> int:
    """Dispatch inbox events whose retry is due or whose dispatch was lost; return how many."""
    return dispatch_due(limit=limit)


@task("django_idempotency.purge_processed_inbox_events")
def purge_processed_inbox_events(max_seconds: float | None = 240.0) -> int:
    """Delete processed inbox events older than ``INBOX_RETENTION``; return how many."""
    return InboxEvent.objects.purge_processed(max_seconds=max_seconds)


@task("django_idempotency.relay_outbox")
def relay_outbox(batch_size: int = 50, max_seconds: float | None = 240.0) -> int:
    """Dispatch the outbox's due messages; return how many were dispatched."""
    return relay(batch_size=batch_size, max_seconds=max_seconds).dispatched


@task("django_idempotency.purge_dispatched_outbox_messages")
def purge_dispatched_outbox_messages(max_seconds: float | None = 240.0) -> int:
    """Delete dispatched outbox messages older than ``OUTBOX_RETENTION``; return how many."""
    return OutboxMessage.objects.purge_dispatched(max_seconds=max_seconds)
