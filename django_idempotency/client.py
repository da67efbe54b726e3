"""Retrying HTTP clients for outgoing calls: httpx transports and a requests adapter.

A request is retried only when sending it again is safe: an idempotent method, or a ``POST`` or
``PATCH`` that carries an idempotency key. Waits use exponential backoff with jitter, honour
``Retry-After``, never run past a total deadline, and draw on a per-host retry budget, so that
retries cannot multiply the load on a service that is already failing.

Within a request that ``RetryGuardMiddleware`` handles, the client also keeps the promises of the
request's caller (``django_idempotency.guard``): it does not retry when the caller retries, and it
does not wait past the caller's deadline. It tells the services it calls the same, in the
``Do-Not-Retry`` and ``Request-Timeout-Ms`` headers.

The loop is tenacity's; this module supplies its retry, wait and stop decisions. The httpx
transports are defined only if httpx is installed, the requests adapter only if requests is.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import logging
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from datetime import UTC
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar, cast
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured

from django_idempotency import _optional, guard
from django_idempotency.backoff import decorrelated_jitter, equal_jitter, full_jitter

with _optional.requires("client", __name__):
    import tenacity
    from tenacity.retry import retry_base
    from tenacity.stop import stop_base
    from tenacity.wait import wait_base

try:
    import httpx
except ImportError:
    _HAVE_HTTPX = False
else:
    _HAVE_HTTPX = True

try:
    import requests
    from requests.adapters import HTTPAdapter
except ImportError:
    _HAVE_REQUESTS = False
else:
    _HAVE_REQUESTS = True

if TYPE_CHECKING:
    from collections.abc import (
        AsyncIterable,
        Awaitable,
        Callable,
        Iterable,
        Mapping,
        MutableMapping,
    )

__all__ = [
    "RETRYABLE_STATUSES",
    "AsyncRetryTransport",
    "RetryAdapter",
    "RetryBudget",
    "RetryBudgets",
    "RetryPolicy",
    "RetryTransport",
    "retrying_async_client",
    "retrying_client",
    "retrying_session",
]

logger = logging.getLogger(__name__)

# What each HTTP library's part of the module defines, for the error that names the library.
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
        # Only reached for a name the module does not define: one whose HTTP library is missing.
        if name in _NEEDS:
            library = _NEEDS[name]
            msg = f"{__name__}.{name} needs {library}, not installed: pip install {library}"
            raise ImproperlyConfigured(msg)
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)


#: Statuses worth another attempt: the request timed out, came too early, was rate limited, or
#: the server failed in a way that may pass. 501 and 505 will not pass.
RETRYABLE_STATUSES: Final = frozenset({408, 425, 429, *range(500, 600)} - {501, 505})

#: Methods that RFC 9110 §9.2.2 defines as idempotent: sending one twice has the effect of once.
IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})

#: Methods that are safe to send again only with an idempotency key.
KEYED_METHODS: Final = frozenset({"POST", "PATCH"})

Jitter = Literal["full", "equal", "decorrelated"]

# A discarded response is read to its end so that its connection can be reused, unless its body
# is longer than this; then the connection is closed instead.
_DRAIN_LIMIT: Final = 64 * 1024

# An attempt made with no time left still gets this long (seconds): it fails at once, with the
# HTTP client's own timeout error.
_MIN_TIMEOUT: Final = 0.001

# Budget amounts are counted in millionths of a token, so that sums of deposits are exact.
_TOKEN: Final = 1_000_000

R = TypeVar("R")


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


def _check_budget(ttl: float, min_retries_per_second: float, percent_can_retry: float) -> None:
    if not ttl > 0:
        msg = f"ttl must be positive, not {ttl!r}"
        raise ValueError(msg)
    if not min_retries_per_second >= 0 or not percent_can_retry >= 0:
        msg = "min_retries_per_second and percent_can_retry must not be negative"
        raise ValueError(msg)


_SHARED_BUDGETS: Final = RetryBudgets()


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Say how often, how long apart and until when a request may be retried."""

    max_attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 10.0
    deadline: float = 30.0
    jitter: Jitter = "full"
    budget: RetryBudgets | None = _SHARED_BUDGETS
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


def _parse_retry_after(value: str, now: float) -> float | None:
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


@dataclass(frozen=True)
class _Decision:
    attempt: int
    delay: float
    stop: str | None


class _Operation(Generic[R]):
    """Decide for one logical request, over its attempts, what to retry and how long to wait."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        method: str,
        host: str,
        headers: MutableMapping[str, str],
        replayable: bool,
        status: Callable[[R], int],
        retry_after: Callable[[R], str | None],
        transient: Callable[[BaseException], bool],
        set_timeout: Callable[[float], None],
    ) -> None:
        self.policy = policy
        self.method = method.upper()
        self.host = host
        self.headers = headers
        self._status = status
        self._retry_after = retry_after
        self._transient = transient
        self._set_timeout = set_timeout
        keyed = policy.key_header in headers
        if not keyed and policy.add_keys and self.method in KEYED_METHODS:
            # Added once, to the original request, so that every retry repeats the same key and
            # the server can recognise the retries as one operation.
            headers[policy.key_header] = str(uuid.uuid4())
            keyed = True
        self.retryable = (
            replayable
            and policy.max_attempts > 1
            and (self.method in IDEMPOTENT_METHODS or (self.method in KEYED_METHODS and keyed))
        )
        inbound = guard.current() if policy.propagate else guard.Inbound()
        if not inbound.retries_allowed:
            # The caller of the request being handled retries it: retrying here too would
            # multiply the attempts on the service below.
            self.retryable = False
        if policy.propagate and (self.retryable or not inbound.retries_allowed):
            headers[guard.DO_NOT_RETRY_HEADER] = "1"
        self.budget = None if policy.budget is None else policy.budget.budget_for(host)
        if self.budget is not None:
            self.budget.deposit()
        self.started = policy.clock()
        caller_waits = inbound.remaining()
        self.deadline = self.started + (
            policy.deadline if caller_waits is None else min(policy.deadline, caller_waits)
        )
        self.reason = ""
        self.discarded: R | None = None
        self._previous_delay = policy.base_delay
        self._decision: _Decision | None = None

    def failure(self, state: tenacity.RetryCallState) -> str | None:
        """Return why the last attempt failed, if another attempt may succeed; else None."""
        if not self.retryable:
            return None
        outcome = _outcome(state)
        error = outcome.exception()
        if error is not None:
            return type(error).__name__ if self._transient(error) else None
        status = self._status(outcome.result())
        return f"status {status}" if status in RETRYABLE_STATUSES else None

    def decide(self, state: tenacity.RetryCallState) -> _Decision:
        """Return the wait before the next attempt and whether to stop instead, once per attempt."""
        # Tenacity asks for the wait and the stop separately, in an order that changed between
        # versions; deciding both together spends the budget once, and only on a real retry.
        attempt = state.attempt_number
        if self._decision is None or self._decision.attempt != attempt:
            delay = self._delay(attempt, _response(state))
            self._decision = _Decision(attempt, delay, self._stop(attempt, delay))
        return self._decision

    def _delay(self, attempt: int, response: R | None) -> float:
        policy = self.policy
        if policy.jitter == "full":
            delay = full_jitter(attempt, policy.base_delay, policy.max_delay, policy.random)
        elif policy.jitter == "equal":
            delay = equal_jitter(attempt, policy.base_delay, policy.max_delay, policy.random)
        else:
            delay = decorrelated_jitter(
                self._previous_delay, policy.base_delay, policy.max_delay, policy.random
            )
            self._previous_delay = delay
        value = None if response is None else self._retry_after(response)
        if value is not None:
            retry_after = _parse_retry_after(value, policy.wall_clock())
            if retry_after is not None:
                delay = max(delay, retry_after)
        return delay

    def _stop(self, attempt: int, delay: float) -> str | None:
        policy = self.policy
        if attempt >= policy.max_attempts:
            return "attempts"
        if delay > policy.max_delay:
            # Only Retry-After can ask for more than max_delay. Coming back sooner than the server
            # asked would be refused again, so the response is returned now.
            return "retry_after"
        if policy.clock() + delay >= self.deadline:
            # The next attempt would have no time left to run.
            return "deadline"
        # Last, so that a token is spent only on a retry that will happen.
        if self.budget is not None and not self.budget.try_withdraw():
            return "budget"
        return None

    def before_sleep(self, state: tenacity.RetryCallState) -> None:
        """Log the retry and set the failed attempt's response aside to be released."""
        decision = self.decide(state)
        logger.info(
            "retrying %s %s in %.3f s after attempt %d: %s",
            self.method,
            self.host,
            decision.delay,
            decision.attempt,
            self.reason,
            extra=self._fields(decision),
        )
        self.discarded = _response(state)

    def give_up(self, state: tenacity.RetryCallState) -> R:
        """Log why there is no retry, then return the last response or raise the last error."""
        decision = self.decide(state)
        logger.info(
            "not retrying %s %s after attempt %d (%s): %s",
            self.method,
            self.host,
            decision.attempt,
            self.reason,
            decision.stop,
            extra={**self._fields(decision), "idempotency_client_stop": decision.stop},
        )
        return cast("R", _outcome(state).result())

    def _fields(self, decision: _Decision) -> dict[str, Any]:
        # No header values or bodies: they may carry credentials or personal data.
        return {
            "idempotency_client_host": self.host,
            "idempotency_client_attempt": decision.attempt,
            "idempotency_client_delay": decision.delay,
            "idempotency_client_reason": self.reason,
        }

    def _pieces(self) -> dict[str, Any]:
        return {
            "retry": _RetryIfTransient(self),
            "wait": _WaitBackoff(self),
            "stop": _StopWhenSpent(self),
            "before_sleep": self.before_sleep,
            "retry_error_callback": self.give_up,
        }

    def before_attempt(self) -> None:
        """Bound the attempt by what is left of the deadline, and tell the server so."""
        left = max(0.0, self.deadline - self.policy.clock())
        # An attempt cannot outlast the deadline: timeouts shrink inward, call after call.
        self._set_timeout(max(left, _MIN_TIMEOUT))
        if self.policy.propagate:
            self.headers[guard.TIMEOUT_HEADER] = str(int(left * 1000))

    def run(self, send: Callable[[], R], discard: Callable[[R], None]) -> R:
        """Send the request until it succeeds or a retry is not allowed."""

        def sleep(seconds: float) -> None:
            if self.discarded is not None:
                discard(self.discarded)
                self.discarded = None
            self.policy.sleep(seconds)

        def attempt() -> R:
            self.before_attempt()
            return send()

        return tenacity.Retrying(sleep=sleep, **self._pieces())(attempt)

    async def arun(
        self, send: Callable[[], Awaitable[R]], discard: Callable[[R], Awaitable[None]]
    ) -> R:
        """Send the request until it succeeds or a retry is not allowed, without blocking."""

        # The response is released here rather than in before_sleep, which older tenacity
        # versions call without awaiting.
        async def sleep(seconds: float) -> None:
            if self.discarded is not None:
                await discard(self.discarded)
                self.discarded = None
            await self.policy.async_sleep(seconds)

        async def attempt() -> R:
            self.before_attempt()
            return await send()

        return cast("R", await tenacity.AsyncRetrying(sleep=sleep, **self._pieces())(attempt))


class _RetryIfTransient(retry_base):
    def __init__(self, operation: _Operation[Any]) -> None:
        self.operation = operation

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        self.operation.reason = self.operation.failure(retry_state) or ""
        return bool(self.operation.reason)


class _WaitBackoff(wait_base):
    def __init__(self, operation: _Operation[Any]) -> None:
        self.operation = operation

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.operation.decide(retry_state).delay


class _StopWhenSpent(stop_base):
    def __init__(self, operation: _Operation[Any]) -> None:
        self.operation = operation

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.operation.decide(retry_state).stop is not None


def _outcome(state: tenacity.RetryCallState) -> tenacity.Future:
    # Tenacity calls the retry, wait and stop pieces only once an attempt has an outcome.
    return cast("tenacity.Future", state.outcome)


def _response(state: tenacity.RetryCallState) -> Any:
    outcome = _outcome(state)
    return None if outcome.failed else outcome.result()


def _host(hostname: str, port: int | None) -> str:
    return hostname if port is None else f"{hostname}:{port}"


def _drain(chunks: Iterable[bytes]) -> None:
    read = 0
    for chunk in chunks:
        read += len(chunk)
        if read > _DRAIN_LIMIT:
            return


async def _adrain(chunks: AsyncIterable[bytes]) -> None:
    read = 0
    async for chunk in chunks:
        read += len(chunk)
        if read > _DRAIN_LIMIT:
            return


if _HAVE_HTTPX:

    def _httpx_transient(error: BaseException) -> bool:
        # Timeouts, connect errors, resets, and a connection closed before the response.
        return isinstance(
            error, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
        )

    # The timeouts of httpx's "timeout" request extension (seconds; None: no limit).
    _HTTPX_TIMEOUTS: Final = ("connect", "read", "write", "pool")

    def _httpx_operation(policy: RetryPolicy, request: httpx.Request) -> _Operation[httpx.Response]:
        configured = dict(request.extensions.get("timeout") or {})

        def set_timeout(seconds: float) -> None:
            request.extensions["timeout"] = {
                name: seconds if configured.get(name) is None else min(configured[name], seconds)
                for name in _HTTPX_TIMEOUTS
            }

        return _Operation(
            policy,
            method=request.method,
            host=_host(request.url.host, request.url.port),
            headers=request.headers,
            replayable=True,
            status=lambda response: response.status_code,
            retry_after=lambda response: response.headers.get("Retry-After"),
            transient=_httpx_transient,
            set_timeout=set_timeout,
        )

    def _discard_httpx(response: httpx.Response) -> None:
        with contextlib.suppress(httpx.HTTPError):
            try:
                if not response.is_stream_consumed:
                    _drain(response.iter_raw())
            finally:
                response.close()

    async def _adiscard_httpx(response: httpx.Response) -> None:
        with contextlib.suppress(httpx.HTTPError):
            try:
                if not response.is_stream_consumed:
                    await _adrain(response.aiter_raw())
            finally:
                await response.aclose()

    class RetryTransport(httpx.BaseTransport):
        """Send each request through ``transport``, retrying it as ``policy`` allows."""

        def __init__(
            self, transport: httpx.BaseTransport | None = None, policy: RetryPolicy | None = None
        ) -> None:
            self.transport = httpx.HTTPTransport() if transport is None else transport
            self.policy = RetryPolicy() if policy is None else policy

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            """Send ``request``, and send it again while it fails and a retry is allowed."""
            operation = _httpx_operation(self.policy, request)
            if operation.retryable:
                # A retry sends the body again: a streamed body is read into memory first.
                request.read()
            return operation.run(
                functools.partial(self.transport.handle_request, request), _discard_httpx
            )

        def close(self) -> None:
            """Close the wrapped transport."""
            self.transport.close()

    class AsyncRetryTransport(httpx.AsyncBaseTransport):
        """Send each request through ``transport``, retrying it as ``policy`` allows."""

        def __init__(
            self,
            transport: httpx.AsyncBaseTransport | None = None,
            policy: RetryPolicy | None = None,
        ) -> None:
            self.transport = httpx.AsyncHTTPTransport() if transport is None else transport
            self.policy = RetryPolicy() if policy is None else policy

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            """Send ``request``, and send it again while it fails and a retry is allowed."""
            operation = _httpx_operation(self.policy, request)
            if operation.retryable:
                await request.aread()
            return await operation.arun(
                functools.partial(self.transport.handle_async_request, request), _adiscard_httpx
            )

        async def aclose(self) -> None:
            """Close the wrapped transport."""
            await self.transport.aclose()

    # The transport options of httpx.Client: they configure the wrapped transport instead.
    _TRANSPORT_OPTIONS: Final = ("verify", "cert", "trust_env", "http1", "http2", "limits", "proxy")

    def _split_options(kwargs: dict[str, Any]) -> dict[str, Any]:
        options = {name: kwargs.pop(name) for name in _TRANSPORT_OPTIONS if name in kwargs}
        if "trust_env" in options:
            kwargs["trust_env"] = options["trust_env"]
        return options

    def retrying_client(policy: RetryPolicy | None = None, **kwargs: Any) -> httpx.Client:
        """Return an ``httpx.Client`` whose requests are retried as ``policy`` allows."""
        transport = kwargs.pop("transport", None)
        options = _split_options(kwargs)
        inner = httpx.HTTPTransport(**options) if transport is None else transport
        return httpx.Client(transport=RetryTransport(inner, policy), **kwargs)

    def retrying_async_client(
        policy: RetryPolicy | None = None, **kwargs: Any
    ) -> httpx.AsyncClient:
        """Return an ``httpx.AsyncClient`` whose requests are retried as ``policy`` allows."""
        transport = kwargs.pop("transport", None)
        options = _split_options(kwargs)
        inner = httpx.AsyncHTTPTransport(**options) if transport is None else transport
        return httpx.AsyncClient(transport=AsyncRetryTransport(inner, policy), **kwargs)


if _HAVE_REQUESTS:

    def _requests_transient(error: BaseException) -> bool:
        # A certificate that failed verification fails again: TLS errors are not retried.
        return isinstance(error, (requests.ConnectionError, requests.Timeout)) and not isinstance(
            error, requests.exceptions.SSLError
        )

    def _discard_requests(response: requests.Response) -> None:
        with contextlib.suppress(requests.RequestException):
            try:
                # Read to the end, so that close() returns the connection to the pool.
                _drain(response.iter_content(16 * 1024))
            finally:
                response.close()

    def _shrink_requests_timeout(timeout: Any, seconds: float) -> Any:
        # requests takes a number, a (connect, read) pair, or None for no limit.
        if isinstance(timeout, tuple):
            return tuple(seconds if part is None else min(part, seconds) for part in timeout)
        return seconds if timeout is None else min(timeout, seconds)

    class RetryAdapter(HTTPAdapter):
        """Send each request of a ``requests.Session``, retrying it as ``policy`` allows.

        A request whose body is a stream or a file is sent once: it cannot be sent again.
        """

        def __init__(self, policy: RetryPolicy | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.policy = RetryPolicy() if policy is None else policy

        def send(  # noqa: PLR0917 - the signature of HTTPAdapter.send
            self,
            request: requests.PreparedRequest,
            stream: bool = False,
            timeout: float | tuple[float, float] | tuple[float, None] | None = None,
            verify: bool | str = True,
            cert: bytes | str | tuple[bytes | str, bytes | str] | None = None,
            proxies: Mapping[str, str] | None = None,
        ) -> requests.Response:
            """Send ``request``, and send it again while it fails and a retry is allowed."""
            url = urlsplit(request.url or "")
            attempt_timeout: list[Any] = [timeout]

            def set_timeout(seconds: float) -> None:
                attempt_timeout[0] = _shrink_requests_timeout(timeout, seconds)

            operation: _Operation[requests.Response] = _Operation(
                self.policy,
                method=request.method or "GET",
                host=_host(url.hostname or "", url.port),
                headers=request.headers,
                replayable=request.body is None or isinstance(request.body, (bytes, str)),
                status=lambda response: response.status_code,
                retry_after=lambda response: response.headers.get("Retry-After"),
                transient=_requests_transient,
                set_timeout=set_timeout,
            )

            def send() -> requests.Response:
                return super(RetryAdapter, self).send(
                    request,
                    stream=stream,
                    timeout=attempt_timeout[0],
                    verify=verify,
                    cert=cert,
                    proxies=proxies,
                )

            return operation.run(send, _discard_requests)

    def retrying_session(policy: RetryPolicy | None = None) -> requests.Session:
        """Return a ``requests.Session`` whose requests are retried as ``policy`` allows."""
        session = requests.Session()
        adapter = RetryAdapter(policy)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        return session
