"""Backoff with jitter, as the retrying client and the inbox and outbox retries wait.

They live in ``django_idempotency.queue``, which the inbox and the outbox share.
"""

from __future__ import annotations

from django_idempotency.queue.backoff import decorrelated_jitter, equal_jitter, full_jitter

__all__ = ["decorrelated_jitter", "equal_jitter", "full_jitter"]
