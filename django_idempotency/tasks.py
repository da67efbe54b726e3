"""Celery tasks; the only module that imports Celery. Schedule them with Celery beat.

Every task is safe to run on several workers at once and when beat fires twice.
"""

from __future__ import annotations

from celery import shared_task

from django_idempotency.models import IdempotencyKey


@shared_task(name="django_idempotency.purge_expired_keys", ignore_result=True)  # type: ignore[untyped-decorator] # Celery ships no types
def purge_expired_keys(
    batch_size: int = 10_000, pause: float = 0.0, max_seconds: float | None = 240.0
) -> int:
    """Delete keys past their expiry; return how many were deleted."""
    result = IdempotencyKey.objects.purge_expired(
        batch_size=batch_size, pause=pause, max_seconds=max_seconds
    )
    return result.deleted


@shared_task(name="django_idempotency.sweep_expired_leases", ignore_result=True)  # type: ignore[untyped-decorator] # Celery ships no types
def sweep_expired_leases() -> int:
    """Mark keys whose lease ran out as failed; return how many."""
    return IdempotencyKey.objects.sweep_expired_leases()
