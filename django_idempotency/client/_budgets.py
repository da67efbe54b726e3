"""Retry budgets: retries allowed in proportion to first attempts, one budget per host."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

# Budget amounts are counted in millionths of a token, so that sums of deposits are exact.
_TOKEN: Final = 1_000_000


class RetryBudget:
    """Allow retries in proportion to recent first attempts, plus a reserve that refills.

    Every first attempt deposits ``percent_can_retry`` of a token and every retry withdraws one.
    Deposits and withdrawals both expire after ``ttl`` seconds.
    """

    # Finagle's RetryBudget: a retry ratio bounds the extra load retries add to a failing service,
    # and the reserve of min_retries_per_second * ttl lets a service with little traffic retry.
    def __init__(
        self,
        ttl: float = 10.0,
        min_retries_per_second: float = 10.0,
        percent_can_retry: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_budget(ttl, min_retries_per_second, percent_can_retry)
        self.ttl = ttl
        self.clock = clock
        self._deposit = round(percent_can_retry * _TOKEN)
        self._reserve = round(min_retries_per_second * ttl * _TOKEN)
        self._entries: deque[tuple[float, int]] = deque()
        self._total = 0
        self._lock = threading.Lock()

    def deposit(self) -> None:
        """Record a first attempt."""
        with self._lock:
            now = self._expire()
            if self._deposit:
                self._entries.append((now, self._deposit))
                self._total += self._deposit

    def try_withdraw(self) -> bool:
        """Take one token for a retry; return False, and take nothing, if there is not one."""
        with self._lock:
            now = self._expire()
            if self._reserve + self._total < _TOKEN:
                return False
            self._entries.append((now, -_TOKEN))
            self._total -= _TOKEN
            return True

    @property
    def balance(self) -> float:
        """Return the tokens available now: how many retries the budget would allow."""
        with self._lock:
            self._expire()
            return (self._reserve + self._total) / _TOKEN

    def _expire(self) -> float:
        now = self.clock()
        while self._entries and self._entries[0][0] <= now - self.ttl:
            self._total -= self._entries.popleft()[1]
        return now


class RetryBudgets:
    """Keep one ``RetryBudget`` per host, each created on first use with these settings."""

    def __init__(
        self,
        ttl: float = 10.0,
        min_retries_per_second: float = 10.0,
        percent_can_retry: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_budget(ttl, min_retries_per_second, percent_can_retry)
        self._settings = (ttl, min_retries_per_second, percent_can_retry, clock)
        self._budgets: dict[str, RetryBudget] = {}
        self._lock = threading.Lock()

    def budget_for(self, host: str) -> RetryBudget:
        """Return the budget of ``host`` (a host name, with ``:port`` if the URL names one)."""
        with self._lock:
            budget = self._budgets.get(host)
            if budget is None:
                budget = self._budgets[host] = RetryBudget(*self._settings)
            return budget


def host_of(hostname: str, port: int | None) -> str:
    """Return the name a URL's host goes by in budgets and logs."""
    return hostname if port is None else f"{hostname}:{port}"


def _check_budget(ttl: float, min_retries_per_second: float, percent_can_retry: float) -> None:
    if not ttl > 0:
        msg = f"ttl must be positive, not {ttl!r}"
        raise ValueError(msg)
    if not min_retries_per_second >= 0 or not percent_can_retry >= 0:
        msg = "min_retries_per_second and percent_can_retry must not be negative"
        raise ValueError(msg)


#: The budgets of every policy that does not bring its own.
SHARED_BUDGETS: Final = RetryBudgets()
