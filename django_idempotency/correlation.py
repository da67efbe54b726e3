"""Correlation ids: the middleware, the log filter and the current id, under the names the
settings refer to (``MIDDLEWARE``, ``LOGGING``).

This module is their one public path. They live in the core (``core/correlation.py``), where
the inbox, the outbox, the client and the engine's reports read the id without importing
anything above them.
"""

from __future__ import annotations

from django_idempotency.core.correlation import (
    CorrelationIdFilter,
    CorrelationIdMiddleware,
    get_correlation_id,
)

__all__ = ["CorrelationIdFilter", "CorrelationIdMiddleware", "get_correlation_id"]
