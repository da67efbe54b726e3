"""``manage.py idempotency_sweep``: fail keys whose lease ran out, for cron users."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from django_idempotency.models import IdempotencyKey


class Command(BaseCommand):
    help = "Mark lease-mode keys whose lease ran out as failed, so that a retry runs them again."

    def handle(self, *args: Any, **options: Any) -> None:
        swept = IdempotencyKey.objects.sweep_expired_leases()
        self.stdout.write(f"Swept {swept} expired leases.")
