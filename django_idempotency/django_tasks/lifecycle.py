"""The package's periodic work as tasks of Django's Tasks framework, for a project without Celery.

The same work as the Celery tasks of ``django_idempotency.tasks`` and the management commands,
declared with the framework's ``@task`` on its default backend and queue (``.using()`` sends one
elsewhere). The framework has no scheduler: enqueue them from cron (``manage.py
idempotency_enqueue``), or run the management commands from cron instead. Every task is safe to
run on several workers at once and when it is enqueued twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_idempotency.django_tasks import framework
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

if TYPE_CHECKING:
    from collections.abc import Callable

#: The framework's ``@task``, on the default backend and queue.
task: Callable[[Callable[..., Any]], Any] = framework.task


@task
def purge_expired_keys(
    batch_size: int = 1_000, pause: float | None = None, max_seconds: float | None = 240.0
) -> int:
    """Delete keys past their expiry; return how many were deleted."""
    result = IdempotencyKey.objects.purge_expired(
        batch_size=batch_size, pause=pause, max_seconds=max_seconds
    )
    return result.deleted


@task
def sweep_expired_leases() -> int:
    """Settle keys whose lease ran out (asking the RECONCILE hook, if any); return how many."""
    return IdempotencyKey.objects.sweep_expired_leases()


@task
def process_inbox_event(event_pk: int) -> str:
    """Attempt to process one inbox event; return the outcome."""
    return process(event_pk).value


@task
def dispatch_due_inbox_events(limit: int = 500) -> int:
    """Dispatch inbox events whose retry is due or whose dispatch was lost; return how many."""
    return dispatch_due(limit=limit)


@task
def purge_processed_inbox_events(max_seconds: float | None = 240.0) -> int:
    """Delete processed inbox events older than ``INBOX_RETENTION``; return how many."""
    return InboxEvent.objects.purge_processed(max_seconds=max_seconds)


@task
def relay_outbox(batch_size: int = 50, max_seconds: float | None = 240.0) -> int:
    """Dispatch the outbox's due messages; return how many were dispatched."""
    return relay(batch_size=batch_size, max_seconds=max_seconds).dispatched


@task
def purge_dispatched_outbox_messages(max_seconds: float | None = 240.0) -> int:
    """Delete dispatched outbox messages older than ``OUTBOX_RETENTION``; return how many."""
    return OutboxMessage.objects.purge_dispatched(max_seconds=max_seconds)
