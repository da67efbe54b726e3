"""The retry-amplification guard: one layer retries, and timeouts shrink inward.

When every layer of a call chain retries three times, four layers make 3 x 3 x 3 x 3 = 81
attempts on the service at the bottom, the one that is already failing. The retry client
(``django_idempotency.client``) therefore tells the service it calls two things, in headers:

- ``Do-Not-Retry: 1``: "I retry this request; do not retry the calls you make for it";
- ``Request-Timeout-Ms: <n>``: "I wait at most n more milliseconds for your answer".

``RetryGuardMiddleware`` reads them on the way in, and the retry client, called by a view while
that request is handled, honours them: it sends each call once and passes ``Do-Not-Retry`` on,
and it never waits past the caller's deadline, passing what is left of it on in turn.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from django_idempotency.core.middleware import SyncAndAsyncMiddleware

if TYPE_CHECKING:
    from collections.abc import Awaitable, Iterator, Mapping

    from django.http import HttpRequest, HttpResponseBase

__all__ = [
    "RetryGuardMiddleware",
    "current",
    "remaining",
    "retries_allowed",
]

#: Sent by a caller that retries the request itself: the callee must not retry on its behalf.
DO_NOT_RETRY_HEADER: Final = "Do-Not-Retry"

#: The milliseconds the caller still waits for the answer, a non-negative integer.
TIMEOUT_HEADER: Final = "Request-Timeout-Ms"

#: The same in seconds (a non-negative decimal number), as other clients send it; read only when
#: ``Request-Timeout-Ms`` is absent.
SECONDS_TIMEOUT_HEADER: Final = "X-Request-Timeout"

# A caller's timeout is capped at a day: a larger value is no deadline worth propagating.
_MAX_TIMEOUT_MS: Final = 86_400_000


@dataclass(frozen=True)
class Inbound:
    """What the caller of the request being handled asked of the calls made for it."""

    retries_allowed: bool = True
    deadline: float | None = None  # on the time.monotonic() clock

    def remaining(self, now: float | None = None) -> float | None:
        """Return the seconds left until the caller's deadline (never negative), or ``None``."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - (time.monotonic() if now is None else now))


_NO_GUARD: Final = Inbound()
_inbound: ContextVar[Inbound] = ContextVar("django_idempotency_inbound", default=_NO_GUARD)


def current() -> Inbound:
    """Return the guard of the request being handled (no limits outside a request)."""
    return _inbound.get()


def remaining() -> float | None:
    """Return the seconds the current request's caller still waits, or ``None`` if unknown."""
    return _inbound.get().remaining()


def retries_allowed() -> bool:
    """Return False if the current request's caller retries it, so calls made for it must not."""
    return _inbound.get().retries_allowed


def from_headers(headers: Mapping[str, str], now: float | None = None) -> Inbound:
    """Read the guard headers of a request. Malformed values are ignored, as if absent."""
    allowed = headers.get(DO_NOT_RETRY_HEADER, "").strip().lower() not in {"1", "true"}
    milliseconds = _timeout_ms(headers)
    deadline = None
    if milliseconds is not None:
        start = time.monotonic() if now is None else now
        deadline = start + min(milliseconds, _MAX_TIMEOUT_MS) / 1000
    return Inbound(retries_allowed=allowed, deadline=deadline)


def _timeout_ms(headers: Mapping[str, str]) -> float | None:
    value = headers.get(TIMEOUT_HEADER, "").strip()
    if value:
        return int(value) if value.isascii() and value.isdigit() else None
    seconds = headers.get(SECONDS_TIMEOUT_HEADER, "").strip()
    # Digits and one dot only: no sign, exponent, "nan" or "inf".
    if seconds.isascii() and seconds.replace(".", "", 1).isdigit():
        return float(seconds) * 1000
    return None


@contextlib.contextmanager
def inbound(guard: Inbound) -> Iterator[Inbound]:
    """Handle the calls made inside the block as on behalf of a request with ``guard``."""
    token = _inbound.set(guard)
    try:
        yield guard
    finally:
        _inbound.reset(token)


class RetryGuardMiddleware(SyncAndAsyncMiddleware):
    """Make a request's ``Do-Not-Retry`` and ``Request-Timeout-Ms`` bind the calls made for it.

    Put it first in ``MIDDLEWARE``, so the deadline counts from the moment the request arrives.
    Views read what is left with ``django_idempotency.guard.remaining()``; the retry client
    applies both headers by itself.
    """

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self._acall(request)
        with inbound(from_headers(request.headers)):
            response: HttpResponseBase = self.get_response(request)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        with inbound(from_headers(request.headers)):
            response: HttpResponseBase = await self.get_response(request)
        return response
