from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings

from django_idempotency.models import IdempotencyKey
from tests.factories import IdempotencyKeyFactory


@pytest.mark.parametrize(
    "auto_field", ["django.db.models.AutoField", "django.db.models.BigAutoField"]
)
@pytest.mark.django_db
def test_no_missing_migrations(auto_field):
    with override_settings(DEFAULT_AUTO_FIELD=auto_field):
        out = StringIO()
        call_command("makemigrations", "django_idempotency", check=True, dry_run=True, stdout=out)
    assert "No changes detected" in out.getvalue()


def test_the_key_table_has_named_constraints_and_indexes():
    meta = IdempotencyKey._meta
    assert [constraint.name for constraint in meta.constraints] == ["idempotency_scope_key_uniq"]
    assert [index.name for index in meta.indexes] == [
        "idempotency_expires_idx",
        "idempotency_lease_idx",
    ]
    assert meta.pk.get_internal_type() == "BigAutoField"


def test_str():
    key = IdempotencyKeyFactory.build(key="abc", method="POST", route="payments/")
    assert str(key) == "abc (POST payments/)"


@pytest.mark.django_db(transaction=True)  # SQLite's schema editor refuses a transaction
def test_a_partial_index_is_partial_only_where_the_database_has_them():
    from django.db import connection  # noqa: PLC0415

    (index,) = [i for i in IdempotencyKey._meta.indexes if i.name == "idempotency_lease_idx"]
    with connection.schema_editor(collect_sql=True) as editor:
        editor.add_index(IdempotencyKey, index)
    (sql,) = editor.collected_sql
    assert "locked_until" in sql
    # PostgreSQL and SQLite build it on leased rows only; MariaDB on every row, without W037.
    assert ("WHERE" in sql) is connection.features.supports_partial_indexes
    assert index.condition is None
