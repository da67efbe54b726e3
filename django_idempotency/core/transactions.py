"""Transactions that read and then write, made to wait their turn on SQLite.

SQLite lets one connection write at a time, and its transactions start as readers (``BEGIN``
is ``BEGIN DEFERRED``). A transaction that has read and then writes while another connection
holds the write lock fails at once with "database is locked": SQLite skips its busy timeout
there, lest the two connections wait on each other. A transaction that takes the write lock
before it reads waits for it, up to the busy timeout, like any writer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from django.db import connections, transaction

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import Model

# Transaction modes that take the write lock at BEGIN (Django's "transaction_mode" option).
_WRITING_MODES = frozenset({"IMMEDIATE", "EXCLUSIVE"})


@contextmanager
def write_transaction(model: type[Model], using: str) -> Iterator[None]:
    """``transaction.atomic(using=using)`` for work that reads and then writes ``model``'s table.

    On SQLite, unless its transactions already begin IMMEDIATE or EXCLUSIVE, the block's first
    statement takes the write lock. Elsewhere row locks do that work: it is plain ``atomic``.
    """
    with transaction.atomic(using=using):
        connection = connections[using]
        if _begins_as_reader(connection):
            # Also inside an outer transaction: one that has not read waits here as it should,
            # and for one that has written the statement changes nothing.
            quote = connection.ops.quote_name
            table, pk = quote(model._meta.db_table), quote(model._meta.pk.column)
            with connection.cursor() as cursor:
                # Updates nothing, but an UPDATE takes the write lock before its WHERE is read.
                cursor.execute(f"UPDATE {table} SET {pk} = {pk} WHERE 0")  # noqa: S608 - quoted identifiers
        yield


def _begins_as_reader(connection: BaseDatabaseWrapper) -> bool:
    mode = connection.settings_dict["OPTIONS"].get("transaction_mode")
    return connection.vendor == "sqlite" and (mode or "DEFERRED").upper() not in _WRITING_MODES


class CommitWatch:
    """Tells where an exception that left a transaction came from.

    A failure at ``COMMIT`` (a deferred foreign key, say) belongs to the statements that caused
    it, not to the ones the block ran last; one raised by an ``on_commit`` callback comes after a
    commit that went through. Enter :meth:`watch` last, inside the transaction it watches.
    """

    def __init__(self) -> None:
        self.reached_commit = False  # the block ran to its end
        self.committed = False

    @property
    def failed_at_commit(self) -> bool:
        return self.reached_commit and not self.committed

    @contextmanager
    def watch(self, using: str) -> Iterator[None]:
        # Registered first in the block, so that it runs first once the commit went through.
        transaction.on_commit(self._mark_committed, using=using, robust=True)
        yield
        self.reached_commit = True

    def _mark_committed(self) -> None:
        self.committed = True
