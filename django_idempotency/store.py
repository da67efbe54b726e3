"""The key store's public name: ``replay_counts``, the replays counted in memory, which a test
suite that rolls each test back flushes or discards.

The store lives in ``django_idempotency.core``.
"""

from __future__ import annotations

from django_idempotency.core.store import replay_counts

__all__ = ["replay_counts"]
