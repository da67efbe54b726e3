"""Inbox events count their deliveries; on PostgreSQL, an index serves the admin's key prefix search.

The admin finds a key from its first characters (``key LIKE 'b5a91b5c%'``). PostgreSQL's btree
indexes in a database whose collation is not C cannot serve LIKE, so the key gets an index of its
own with the ``varchar_pattern_ops`` operator class. MariaDB compares keys byte for byte (0005),
and SQLite by default: there the unique index on (key, scope), which the key leads, serves the
search already, and this index is not built.

The index is built CONCURRENTLY, so that the key table, the busiest table, takes writes while it
is built: the migration is not atomic (PostgreSQL cannot build an index concurrently in a
transaction).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models


INDEX = "idempotency_key_prefix_idx"


def create_prefix_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    model = apps.get_model("django_idempotency", "IdempotencyKey")
    table = schema_editor.quote_name(model._meta.db_table)
    # An interrupted concurrent build leaves an invalid index of that name behind.
    schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")
    schema_editor.execute(f"CREATE INDEX CONCURRENTLY {INDEX} ON {table} (key varchar_pattern_ops)")


def drop_prefix_index(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY

    dependencies = [
        ('django_idempotency', '0006_partial_indexes_everywhere'),
    ]

    operations = [
        migrations.AddField(
            model_name='inboxevent',
            name='deliveries',
            field=models.PositiveIntegerField(default=1, help_text='Times the sender delivered the event, duplicates included.', verbose_name='deliveries'),
        ),
        migrations.AddField(
            model_name='inboxevent',
            name='last_delivered_at',
            field=models.DateTimeField(blank=True, help_text='When the last duplicate delivery arrived; empty if none did.', null=True, verbose_name='last delivered at'),
        ),
        migrations.RunPython(create_prefix_index, drop_prefix_index, elidable=False),
    ]
