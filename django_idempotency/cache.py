"""The optional replay cache: completed responses served from a Django cache (Redis).

An accelerator, never the arbiter. Only completed responses are cached, after their
transaction commits, and only until the key expires; every cache error is logged and the
database answers instead. A stopped, flushed or failed-over cache costs speed, never a second
effect and never an error.
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from django.core.cache import caches
from django.db import transaction
from django.utils import timezone

from django_idempotency.store import StoredResponse

if TYPE_CHECKING:
    from datetime import datetime

    from django.core.cache import BaseCache

logger = logging.getLogger("django_idempotency")


def _cache_key(scope: str, key: str) -> str:
    return "idempotency:" + hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()


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
        try:
            entry: Any = self.cache.get(_cache_key(scope, key))
        except Exception:  # any cache failure: the database answers instead
            logger.warning("replay cache unavailable; reading the database", exc_info=True)
            return None
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
            if timeout <= 0:
                return
            try:
                self.cache.set(_cache_key(scope, key), entry, timeout=timeout)
            except Exception:  # the cache is optional: keep going without it
                logger.warning("replay cache unavailable; response not cached", exc_info=True)

        transaction.on_commit(put, using=using)
