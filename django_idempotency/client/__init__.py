"""Retrying HTTP clients for outgoing calls: httpx transports and a requests adapter.

A request is retried only when sending it again is safe: an idempotent method, or a ``POST`` or
``PATCH`` that carries an idempotency key. Waits use exponential backoff with jitter, honour
``Retry-After``, never run past a total deadline, and draw on a per-host retry budget, so that
retries cannot multiply the load on a service that is already failing. A per-host circuit
breaker goes further: after repeated failures it fails requests to the host fast, without sending
them, until a trial request succeeds.

Within a request that ``RetryGuardMiddleware`` handles, the client also keeps the promises of the
request's caller (``django_idempotency.guard``): it does not retry when the caller retries, and it
does not wait past the caller's deadline. It tells the services it calls the same, in the
``Do-Not-Retry`` and ``Request-Timeout-Ms`` headers.

The loop is tenacity's; this package supplies its retry, wait and stop decisions. The httpx
transports are defined only if httpx is installed, the requests adapter only if requests is.
Everything public is imported from here, its one import path; the modules behind it are private,
and each class and function names the one that defines it (``__module__``), as Django's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.client import _breaker
from django_idempotency.client._breaker import (
    STATES,
    CircuitBreaker,
    CircuitBreakers,
    CircuitOpen,
)
from django_idempotency.client._budgets import RetryBudget, RetryBudgets

# The names marked F401 are public too, though __all__ has never listed them.
from django_idempotency.client._policy import (
    IDEMPOTENT_METHODS,  # noqa: F401
    KEYED_METHODS,  # noqa: F401
    RETRYABLE_STATUSES,
    Jitter,  # noqa: F401
    RetryPolicy,
)
from django_idempotency.core import optional

# What the metrics read of every host's circuit: its possible states, and the circuits in use.
CIRCUIT_STATES: Final = STATES
all_breakers = _breaker.all_breakers

# Tenacity runs every retry loop: without it the package has nothing to offer, whichever HTTP
# library is installed.
with optional.requires("client", __name__):
    from django_idempotency.client._operation import logger  # noqa: F401

if optional.installed("httpx"):
    from django_idempotency.client._httpx import (
        AsyncRetryTransport,
        RetryTransport,
        retrying_async_client,
        retrying_client,
    )

if optional.installed("requests.adapters"):
    from django_idempotency.client._requests import RetryAdapter, retrying_session

__all__ = [
    "RETRYABLE_STATUSES",
    "AsyncRetryTransport",
    "CircuitBreaker",
    "CircuitBreakers",
    "CircuitOpen",
    "RetryAdapter",
    "RetryBudget",
    "RetryBudgets",
    "RetryPolicy",
    "RetryTransport",
    "retrying_async_client",
    "retrying_client",
    "retrying_session",
]

# What each HTTP library's part of the package defines, for the error that names the library.
_NEEDS: Final = {
    "RetryTransport": "httpx",
    "AsyncRetryTransport": "httpx",
    "retrying_client": "httpx",
    "retrying_async_client": "httpx",
    "RetryAdapter": "requests",
    "retrying_session": "requests",
}

if not TYPE_CHECKING:  # a module __getattr__ would make every name type-check

    def __getattr__(name: str) -> Any:
        # Only reached for a name the package does not define: one whose HTTP library is missing.
        if name in _NEEDS:
            library = _NEEDS[name]
            msg = f"{__name__}.{name} needs {library}, not installed: pip install {library}"
            raise ImproperlyConfigured(msg)
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
