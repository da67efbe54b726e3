"""A stand-in for a payment provider, slow enough for concurrent duplicates to overlap."""

from __future__ import annotations

import time
import uuid

LATENCY = 0.2
"""Seconds each authorization takes."""


def authorize(amount: int, currency: str) -> str:
    """Pretend to authorize ``amount`` and return the provider's reference for it.

    It runs inside the view's transaction, holding the key's row meanwhile. This fake has no
    effect outside the database, so a rollback undoes everything it did.
    """
    time.sleep(LATENCY)
    return f"auth_{uuid.uuid4().hex[:16]}"
