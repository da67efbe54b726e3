"""``manage.py idempotency_sweep``: settle keys whose lease ran out, for cron users."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_idempotency.models import IdempotencyKey


class Command(BaseCommand):
    help = (
        "Settle lease-mode keys whose lease ran out: ask the RECONCILE hook, if there is one, "
        "else mark them failed, so that a retry runs them again."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        result = IdempotencyKey.objects.settle_expired_leases()
        if not (result.reconciled or result.unknown or result.errors):
            self.stdout.write(f"Swept {result.settled} expired leases.")
            return
        self.stdout.write(
            f"Swept {result.settled} expired leases: {result.released} released, "
            f"{result.reconciled} reconciled, {result.unknown} left for a person, "
            f"{result.errors} hook errors."
        )
