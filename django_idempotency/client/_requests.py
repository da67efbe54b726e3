"""The requests adapter and session; imported by the package only when requests is installed."""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from django_idempotency.client._breaker import CircuitOpen
from django_idempotency.client._budgets import host_of
from django_idempotency.client._operation import Operation, drain
from django_idempotency.client._policy import RetryPolicy
from django_idempotency.client._start import start_operation

if TYPE_CHECKING:
    from collections.abc import Mapping


class _CircuitOpen(CircuitOpen, requests.ConnectionError):
    """The ``CircuitOpen`` of requests: caught as any ``requests.ConnectionError`` is."""


def _transient(error: BaseException) -> bool:
    # A certificate that failed verification fails again: TLS errors are not retried.
    return isinstance(error, (requests.ConnectionError, requests.Timeout)) and not isinstance(
        error, requests.exceptions.SSLError
    )


def _discard(response: requests.Response) -> None:
    with contextlib.suppress(requests.RequestException):
        try:
            # Read to the end, so that close() returns the connection to the pool.
            drain(response.iter_content(16 * 1024))
        finally:
            response.close()


def _shrink_timeout(timeout: Any, seconds: float) -> Any:
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
            attempt_timeout[0] = _shrink_timeout(timeout, seconds)

        operation: Operation[requests.Response] = start_operation(
            self.policy,
            method=request.method or "GET",
            host=host_of(url.hostname or "", url.port),
            headers=request.headers,
            replayable=request.body is None or isinstance(request.body, (bytes, str)),
            status=lambda response: response.status_code,
            retry_after=lambda response: response.headers.get("Retry-After"),
            transient=_transient,
            set_timeout=set_timeout,
            circuit_open=functools.partial(_CircuitOpen, request=request),
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

        return operation.run(send, _discard)


def retrying_session(policy: RetryPolicy | None = None) -> requests.Session:
    """Return a ``requests.Session`` whose requests are retried as ``policy`` allows."""
    session = requests.Session()
    adapter = RetryAdapter(policy)
    session.mount("https://", adapter)
    session.mount("http://", adapter)
    return session
