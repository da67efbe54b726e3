"""What may be retried, and how long to wait: the retry policy, backoff and ``Retry-After``."""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Final, Literal

from django_idempotency.backoff import decorrelated_jitter, equal_jitter, full_jitter
from django_idempotency.client._breaker import SHARED_BREAKERS, CircuitBreakers
from django_idempotency.client._budgets import SHARED_BUDGETS, RetryBudgets

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

#: Statuses worth another attempt: the request timed out, came too early, was rate limited, or
#: the server failed in a way that may pass. 501 and 505 will not pass.
RETRYABLE_STATUSES: Final = frozenset({408, 425, 429, *range(500, 600)} - {501, 505})

#: Statuses that count against a host's circuit: the retryable ones that blame the server. 408,
#: 425 and 429 blame the request or its sender, and Retry-After already paces those.
FAILING_STATUSES: Final = frozenset(status for status in RETRYABLE_STATUSES if status >= 500)

#: Retried only with an idempotency key and a Retry-After: a duplicate of a request still running.
CONFLICT: Final = 409

#: Methods that RFC 9110 §9.2.2 defines as idempotent: sending one twice has the effect of once.
IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})

#: Methods that are safe to send again only with an idempotency key.
KEYED_METHODS: Final = frozenset({"POST", "PATCH"})

Jitter = Literal["full", "equal", "decorrelated"]


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Say how often, how long apart and until when a request may be retried."""

    max_attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 10.0
    deadline: float = 30.0
    jitter: Jitter = "full"
    budget: RetryBudgets | None = SHARED_BUDGETS
    breaker: CircuitBreakers | None = SHARED_BREAKERS
    key_header: str = "Idempotency-Key"
    add_keys: bool = True
    propagate: bool = True
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    async_sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    random: Callable[[], float] = random.random

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            msg = f"max_attempts counts the first attempt: at least 1, not {self.max_attempts}"
            raise ValueError(msg)
        if not 0 <= self.base_delay <= self.max_delay:
            msg = "base_delay must be between 0 and max_delay"
            raise ValueError(msg)
        if not self.deadline > 0:
            msg = f"deadline must be positive, not {self.deadline!r}"
            raise ValueError(msg)
        if self.jitter not in {"full", "equal", "decorrelated"}:
            msg = f"jitter must be 'full', 'equal' or 'decorrelated', not {self.jitter!r}"
            raise ValueError(msg)
        if not self.key_header:
            msg = "key_header must name a header"
            raise ValueError(msg)


def backoff(policy: RetryPolicy, attempt: int, previous: float) -> float:
    """Return the wait after attempt ``attempt``; ``previous`` is the wait before it."""
    if policy.jitter == "full":
        return full_jitter(attempt, policy.base_delay, policy.max_delay, policy.random)
    if policy.jitter == "equal":
        return equal_jitter(attempt, policy.base_delay, policy.max_delay, policy.random)
    return decorrelated_jitter(previous, policy.base_delay, policy.max_delay, policy.random)


def parse_retry_after(value: str, now: float) -> float | None:
    """Return the seconds a ``Retry-After`` value asks to wait, or None if it is malformed."""
    # RFC 9110 §10.2.3: delay-seconds (1*DIGIT) or an HTTP-date. A date in the past means now.
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except ValueError:
        return None
    if when.tzinfo is None:
        # HTTP-dates are in GMT (RFC 9110 §5.6.7); "-0000" parses as a naive datetime.
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)
