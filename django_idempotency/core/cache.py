"""The optional replay cache: completed responses served from a Django cache (Redis).

An accelerator, never the arbiter. Only completed responses are cached, after their
transaction commits, and only until the key expires; every cache error is logged and the
database answers instead. A stopped, flushed or failed-over cache costs speed, never a second
effect and never an error. A cache that keeps failing is bypassed for a while (a circuit
breaker per cache and process), so that a frozen Redis does not charge every request its
timeout.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from django.core.cache import caches
from django.core.signals import setting_changed
from django.db import transaction
from django.dispatch import receiver
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.core.rows import StoredResponse

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from django.core.cache import BaseCache

logger = logging.getLogger("django_idempotency")


def _cache_key(scope: str, key: str) -> str:
    return "idempotency:" + hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()


class CircuitBreaker:
    """Bypass a cache that keeps failing: after ``threshold`` failures in a row, skip it for
    ``cool_down`` seconds, then let one call try it again. ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        alias: str,
        *,
        threshold: int = 3,
        cool_down: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.alias = alias
        self.threshold = threshold
        self.cool_down = cool_down
        self.clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._retry_at = 0.0
        self._trying = False  # one call tries the cache once the cool-down is over

    def allow(self) -> bool:
        """Whether a call may use the cache now; one that may must then call ``record()``."""
        with self._lock:
            if self._failures < self.threshold:
                return True
            if self._trying or self.clock() < self._retry_at:
                return False
            self._trying = True
            return True

    def record(self, *, succeeded: bool) -> None:
        """Count the outcome of a call that ``allow()`` let through."""
        with self._lock:
            was_open = self._failures >= self.threshold
            self._trying = False
            if succeeded:
                self._failures = 0
            else:
                self._failures += 1
                if self._failures >= self.threshold:
                    self._retry_at = self.clock() + self.cool_down
            is_open = self._failures >= self.threshold
        if is_open and not was_open:
            logger.warning(
                "replay cache %r failed %d times in a row; bypassing it for %gs at a time "
                "until it answers again",
                self.alias,
                self.threshold,
                self.cool_down,
            )
        elif was_open and not is_open:
            logger.info("replay cache %r answers again; using it", self.alias)


_breakers: dict[str, CircuitBreaker] = {}
_breakers_lock = threading.Lock()


def breaker_for(alias: str) -> CircuitBreaker:
    """The circuit breaker of the cache named ``alias`` in this process."""
    with _breakers_lock:
        if (breaker := _breakers.get(alias)) is None:
            breaker = _breakers[alias] = CircuitBreaker(alias)
        return breaker


@receiver(setting_changed)
def _forget_breakers(*, setting: str, **kwargs: Any) -> None:
    # An alias may now name another server: its past failures say nothing about it.
    if setting == "CACHES":
        with _breakers_lock:
            _breakers.clear()


def _report_failure(alias: str, operation: str, error: Exception) -> None:
    signals.send_robustly(signals.replay_cache_failed, alias, operation=operation, error=error)


class ReplayCache:
    """Completed responses by (scope, key), in the Django cache named ``alias``."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    @property
    def cache(self) -> BaseCache:
        return caches[self.alias]

    def get(
        self, *, scope: str, key: str, fingerprint: str, now: datetime
    ) -> StoredResponse | None:
        """The stored response for this very request, if the cache has it and it is live."""
        breaker = breaker_for(self.alias)
        if not breaker.allow():
            return None
        succeeded = False
        try:
            entry: Any = self.cache.get(_cache_key(scope, key))
            succeeded = True
        except Exception as exc:  # any cache failure: the database answers instead
            logger.warning("replay cache unavailable; reading the database", exc_info=True)
            _report_failure(self.alias, "get", exc)
            return None
        finally:
            breaker.record(succeeded=succeeded)
        if not entry or entry["fingerprint"] != fingerprint or entry["expires_at"] <= now:
            return None  # a different request, or an expired key: the database decides
        return StoredResponse(
            status=entry["status"],
            headers=[(name, value) for name, value in entry["headers"]],
            body=entry["body"],
            replay_count=0,  # replays served from the cache are not counted
        )

    def put_after_commit(
        self,
        *,
        scope: str,
        key: str,
        fingerprint: str,
        stored: StoredResponse,
        using: str,
    ) -> None:
        """Cache a completed response, until its key expires, once its transaction commits."""
        expires_at = stored.expires_at
        if expires_at is None:
            return
        entry = {
            "fingerprint": fingerprint,
            "expires_at": expires_at,
            "status": stored.status,
            "headers": list(stored.headers),
            "body": stored.body,
        }

        def put() -> None:
            timeout = (expires_at - timezone.now()).total_seconds()
            breaker = breaker_for(self.alias)
            if timeout <= 0 or not breaker.allow():
                return
            succeeded = False
            try:
                self.cache.set(_cache_key(scope, key), entry, timeout=timeout)
                succeeded = True
            except Exception as exc:  # the cache is optional: keep going without it
                logger.warning("replay cache unavailable; response not cached", exc_info=True)
                _report_failure(self.alias, "set", exc)
            finally:
                breaker.record(succeeded=succeeded)

        transaction.on_commit(put, using=using)
