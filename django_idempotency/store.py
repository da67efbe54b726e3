"""The key store's public name: ``replay_counts``, the replays counted in memory, which a test
suite that rolls each test back flushes or discards.

This module is the name's one public path; the store lives in ``django_idempotency.core``,
beneath the engine that uses it.
"""

from __future__ import annotations

from django_idempotency.core.store import replay_counts

__all__ = ["replay_counts"]
