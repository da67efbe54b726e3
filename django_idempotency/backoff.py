"""Retry delays: exponential backoff with jitter.

Jitter spreads the retries of many failures that happened together, so that they do not come
back together (Marc Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015).
The retrying client waits so, and so do the inbox's and the outbox's retries: this module is
their public home, and imports nothing of the package, so that every floor may use it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["decorrelated_jitter", "equal_jitter", "full_jitter"]


def exponential_bound(attempt: int, base: float, cap: float) -> float:
    """The un-jittered delay after failed attempt ``attempt`` (from 1): ``base`` doubled, capped."""
    if attempt < 1:
        msg = f"attempt counts from 1, not {attempt}"
        raise ValueError(msg)
    # Compare exponents before computing the power, so a large attempt cannot overflow.
    if attempt - 1 >= 1024 or base * 2.0 ** (attempt - 1) >= cap:
        return cap
    return base * 2.0 ** (attempt - 1)


def full_jitter(
    attempt: int, base: float, cap: float, random: Callable[[], float] = random.random
) -> float:
    """A delay drawn uniformly between zero and the exponential bound of ``attempt``."""
    return random() * exponential_bound(attempt, base, cap)


def equal_jitter(
    attempt: int, base: float, cap: float, random: Callable[[], float] = random.random
) -> float:
    """Return a delay drawn uniformly between half the exponential bound of ``attempt`` and it."""
    bound = exponential_bound(attempt, base, cap)
    return bound / 2 + random() * bound / 2


def decorrelated_jitter(
    previous: float, base: float, cap: float, random: Callable[[], float] = random.random
) -> float:
    """Return a delay drawn uniformly between ``base`` and three times ``previous``, capped.

    Start with ``previous = base`` and pass each result back in as the next ``previous``.
    """
    # The AWS post's "decorrelated jitter": a delay grows from the last one drawn, not from the
    # attempt number. ``max`` keeps the range ordered if ``previous`` starts below ``base``.
    upper = max(base, 3 * previous)
    return min(cap, base + random() * (upper - base))
