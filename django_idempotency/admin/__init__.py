"""The Django admin: idempotency keys, inbox events, outbox messages. Look, never edit; act through
actions, each of which is logged in the admin's history.

Importing this package registers the three pages: Django's admin autodiscovery imports it.
"""

from __future__ import annotations

from django_idempotency.admin._base import CappedPaginator
from django_idempotency.admin.inbox import InboxEventAdmin
from django_idempotency.admin.keys import IdempotencyKeyAdmin
from django_idempotency.admin.outbox import OutboxMessageAdmin

__all__ = ["CappedPaginator", "IdempotencyKeyAdmin", "InboxEventAdmin", "OutboxMessageAdmin"]
