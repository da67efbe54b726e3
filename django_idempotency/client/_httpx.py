"""The httpx transports and clients; imported by the package only when httpx is installed."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Final

import httpx

from django_idempotency.client._breaker import CircuitOpen
from django_idempotency.client._budgets import host_of
from django_idempotency.client._operation import Operation, adrain, drain
from django_idempotency.client._policy import RetryPolicy
from django_idempotency.client._start import start_operation

# The timeouts of httpx's "timeout" request extension (seconds; None: no limit).
_HTTPX_TIMEOUTS: Final = ("connect", "read", "write", "pool")

# The transport options of httpx.Client: they configure the wrapped transport instead.
_TRANSPORT_OPTIONS: Final = ("verify", "cert", "trust_env", "http1", "http2", "limits", "proxy")


def _transient(error: BaseException) -> bool:
    # Timeouts, connect errors, resets, and a connection closed before the response.
    return isinstance(
        error, (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
    )


class _CircuitOpen(CircuitOpen, httpx.TransportError):
    """The ``CircuitOpen`` of httpx: caught as any ``httpx.TransportError`` is."""


def _start(policy: RetryPolicy, request: httpx.Request) -> Operation[httpx.Response]:
    configured = dict(request.extensions.get("timeout") or {})

    def set_timeout(seconds: float) -> None:
        request.extensions["timeout"] = {
            name: seconds if configured.get(name) is None else min(configured[name], seconds)
            for name in _HTTPX_TIMEOUTS
        }

    return start_operation(
        policy,
        method=request.method,
        host=host_of(request.url.host, request.url.port),
        headers=request.headers,
        replayable=True,
        status=lambda response: response.status_code,
        retry_after=lambda response: response.headers.get("Retry-After"),
        transient=_transient,
        set_timeout=set_timeout,
        circuit_open=functools.partial(_CircuitOpen, request=request),
    )


def _discard(response: httpx.Response) -> None:
    with contextlib.suppress(httpx.HTTPError):
        try:
            if not response.is_stream_consumed:
                drain(response.iter_raw())
        finally:
            response.close()


async def _adiscard(response: httpx.Response) -> None:
    with contextlib.suppress(httpx.HTTPError):
        try:
            if not response.is_stream_consumed:
                await adrain(response.aiter_raw())
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
        operation = _start(self.policy, request)
        if operation.retryable:
            # A retry sends the body again: a streamed body is read into memory first.
            request.read()
        return operation.run(functools.partial(self.transport.handle_request, request), _discard)

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
        operation = _start(self.policy, request)
        if operation.retryable:
            await request.aread()
        return await operation.arun(
            functools.partial(self.transport.handle_async_request, request), _adiscard
        )

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self.transport.aclose()


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


def retrying_async_client(policy: RetryPolicy | None = None, **kwargs: Any) -> httpx.AsyncClient:
    """Return an ``httpx.AsyncClient`` whose requests are retried as ``policy`` allows."""
    transport = kwargs.pop("transport", None)
    options = _split_options(kwargs)
    inner = httpx.AsyncHTTPTransport(**options) if transport is None else transport
    return httpx.AsyncClient(transport=AsyncRetryTransport(inner, policy), **kwargs)
