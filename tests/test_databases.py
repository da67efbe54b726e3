"""What the package's SQL needs to know of its databases: here, the own transactions of sweeps
and purges on a MariaDB connection set above READ COMMITTED."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from django_idempotency.core.databases import again_after_deadlocks

pytestmark = pytest.mark.django_db(transaction=True)


def session_level():
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.tx_isolation")
        return cursor.fetchone()[0]


@pytest.fixture
def repeatable_read():
    """This connection set as MariaDB's own default, REPEATABLE READ, is."""
    if connection.vendor != "mysql":
        pytest.skip("MariaDB's isolation levels")
    connection.ensure_connection()
    kept = connection.isolation_level
    connection.isolation_level = "repeatable read"
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    yield
    connection.isolation_level = kept
    connection.close()  # the next test connects afresh, at its settings' level


def test_a_sweep_s_transactions_run_at_read_committed_and_the_session_stays_as_it_was(
    repeatable_read,
):
    seen = []

    def work():
        for _ in range(2):  # a purge's batch may take two transactions
            with transaction.atomic():
                seen.append(session_level())
        return len(seen)

    assert again_after_deadlocks(work, connection) == 2
    assert seen == ["READ-COMMITTED", "READ-COMMITTED"]
    assert session_level() == "REPEATABLE-READ"


def test_the_session_is_restored_when_the_work_fails(repeatable_read):
    def work():
        raise RuntimeError

    with pytest.raises(RuntimeError):
        again_after_deadlocks(work, connection)
    assert session_level() == "REPEATABLE-READ"
