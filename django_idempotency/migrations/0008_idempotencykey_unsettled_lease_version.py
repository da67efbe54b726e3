from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_idempotency", "0007_inbox_deliveries_key_prefix_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="idempotencykey",
            name="unsettled_lease_version",
            field=models.PositiveBigIntegerField(
                blank=True,
                help_text=(
                    "The lease that the reconcile hook could not settle: while the key is still "
                    "at this lease version, it waits for a person."
                ),
                null=True,
                verbose_name="unsettled lease version",
            ),
        ),
    ]
