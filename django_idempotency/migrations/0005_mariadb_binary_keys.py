"""On MariaDB, compare idempotency keys and inbox event ids byte for byte, as other databases do.

MariaDB's default collations ignore case (and trailing spaces): "Order-1" and "order-1" would be
one key, and two events whose ids differ in case one event. The unique indexes must tell them
apart, so these columns take the binary collation of their character set. Elsewhere this
migration does nothing.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations

# (model, columns of its unique index)
BINARY = [("IdempotencyKey", ("scope", "key")), ("InboxEvent", ("source", "event_id"))]


def _collate(apps: Any, schema_editor: Any, *, binary: bool) -> None:
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    for model_name, names in BINARY:
        model = apps.get_model("django_idempotency", model_name)
        table = model._meta.db_table
        with connection.cursor() as cursor:
            # The table's own collation is what the columns had, and get back on reversal.
            cursor.execute(
                "SELECT c.character_set_name, t.table_collation FROM information_schema.tables t "
                "JOIN information_schema.collation_character_set_applicability c "
                "ON c.collation_name = t.table_collation "
                "WHERE t.table_schema = DATABASE() AND t.table_name = %s",
                [table],
            )
            charset, default = cursor.fetchone()
        collation = f"{charset}_bin" if binary else default
        changes = ", ".join(
            f"MODIFY {quote(field.column)} varchar({field.max_length}) "
            f"CHARACTER SET {charset} COLLATE {collation} NOT NULL"
            for field in map(model._meta.get_field, names)
        )
        schema_editor.execute(f"ALTER TABLE {quote(table)} {changes}")


def binary(apps: Any, schema_editor: Any) -> None:
    _collate(apps, schema_editor, binary=True)


def default(apps: Any, schema_editor: Any) -> None:
    _collate(apps, schema_editor, binary=False)


class Migration(migrations.Migration):
    atomic = False  # MariaDB cannot roll DDL back anyway
    dependencies = [("django_idempotency", "0004_dead_indexes")]
    operations = [migrations.RunPython(binary, default, elidable=False)]
