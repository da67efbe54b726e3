"""Correlation ids: the middleware, the log filter and the current id, under the names the
settings refer to (``MIDDLEWARE``, ``LOGGING``).

They live in ``django_idempotency.operations``, with the metrics and the tracing.
"""

from __future__ import annotations

from django_idempotency.operations.correlation import (
    CorrelationIdFilter,
    CorrelationIdMiddleware,
    get_correlation_id,
)

__all__ = ["CorrelationIdFilter", "CorrelationIdMiddleware", "get_correlation_id"]
