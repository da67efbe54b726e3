from __future__ import annotations

from django.db import migrations, models

import django_idempotency.models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0008_idempotencykey_unsettled_lease_version"),
    ]

    # The counters have defaults in the database: the inbox's INSERT does not name them.
    operations = [
        migrations.AddField(
            model_name="inboxevent",
            name="conflicting_payload",
            field=models.JSONField(
                blank=True,
                help_text="The payload of the last delivery with another payload.",
                null=True,
                verbose_name="conflicting payload",
            ),
        ),
        migrations.AddField(
            model_name="inboxevent",
            name="conflicting_payload_hash",
            field=models.CharField(
                blank=True,
                db_default="",
                max_length=64,
                verbose_name="conflicting payload hash",
            ),
        ),
        migrations.AddField(
            model_name="inboxevent",
            name="conflicts",
            field=models.PositiveIntegerField(
                db_default=0,
                help_text=(
                    "Deliveries of the event's id with another payload: kept apart, never "
                    "processed."
                ),
                verbose_name="conflicts",
            ),
        ),
        migrations.AddField(
            model_name="inboxevent",
            name="last_conflict_at",
            field=models.DateTimeField(
                blank=True,
                help_text="When the last delivery with another payload arrived.",
                null=True,
                verbose_name="last conflict at",
            ),
        ),
        migrations.AddIndex(
            model_name="inboxevent",
            index=django_idempotency.models.PartialIndex(
                fields=["last_conflict_at"],
                name="idempotency_inbox_conflict_idx",
                where=models.Q(("last_conflict_at__isnull", False)),
            ),
        ),
    ]
