"""Helpers for testing idempotent views: a keyed DRF client, an assertion and an off switch.

``IdempotentAPIClient`` needs Django REST framework; ``assert_idempotent`` and
``idempotency_disabled`` work with Django's own test client too.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from django.http import HttpResponse, StreamingHttpResponse
from django.test.utils import TestContextDecorator, override_settings

from django_idempotency.conf import UNSAFE_METHODS, idempotency_settings
from django_idempotency.core.optional import installed, missing
from django_idempotency.core.responses import STATUS_HEADER

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from django.http import HttpResponseBase
    from django.utils.functional import Promise
    from rest_framework.response import _MonkeyPatchedResponse
    from rest_framework.test import APIClient as _APIClient
elif installed("rest_framework"):
    from rest_framework.test import APIClient as _APIClient
else:

    class _APIClient:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise missing("drf", "IdempotentAPIClient")


__all__ = ["IdempotentAPIClient", "assert_idempotent", "idempotency_disabled"]

_ResponseT_co = TypeVar("_ResponseT_co", bound="HttpResponseBase", covariant=True)


def _given_key(header: str, extra: Mapping[str, Any]) -> str | None:
    """The key a caller put in ``headers={...}`` or as a WSGI ``HTTP_...`` name, if any."""
    for name, value in (extra.get("headers") or {}).items():
        if name.lower() == header.lower():
            return str(value)
    value = extra.get("HTTP_" + header.upper().replace("-", "_"))
    return None if value is None else str(value)


def _with_key(header: str, key: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    return {**extra, "headers": {**(extra.get("headers") or {}), header: key}}


@dataclass(frozen=True)
class _Sent:
    """An unsafe request as it went to ``generic()``: enough to send it again, byte for byte."""

    method: str
    path: str | Promise
    data: str | bytes
    content_type: str | None
    secure: bool
    extra: dict[str, Any]


class IdempotentAPIClient(_APIClient):
    """A DRF ``APIClient`` that sends a fresh ``Idempotency-Key`` with each unsafe request.

    ``POST``, ``PUT``, ``PATCH`` and ``DELETE`` (also through ``generic()``) get a new UUID4
    key in the header named by the ``HEADER`` setting, unless the caller passes one; safe
    methods never get one. ``last_key`` is the key of the last unsafe request, and ``retry()``
    sends that request again, byte for byte and with the same key.
    """

    last_key: str | None = None
    _last_sent: _Sent | None = None

    def generic(  # type: ignore[override] # as in APIClient's stub: a client answers responses
        self,
        method: str,
        path: str | Promise,
        data: str | bytes = "",
        content_type: str | None = "application/octet-stream",
        secure: bool = False,
        **extra: Any,
    ) -> _MonkeyPatchedResponse:
        if method.upper() in UNSAFE_METHODS:
            header = idempotency_settings.HEADER
            key = _given_key(header, extra)
            if key is None:
                key = str(uuid.uuid4())
                extra = _with_key(header, key, extra)
            self.last_key = key
            self._last_sent = _Sent(method, path, data, content_type, secure, dict(extra))
        return super().generic(method, path, data, content_type, secure, **extra)  # type: ignore[arg-type] # DRF passes bytes and None

    def retry(self) -> _MonkeyPatchedResponse:
        """Send the last unsafe request again, with the same key, and return the response.

        It goes out as it did the first time: the same method, path, query string, body bytes,
        content type and headers. Safe requests made since do not count, and redirects are not
        followed.
        """
        sent = self._last_sent
        if sent is None:
            msg = "retry() needs an earlier POST, PUT, PATCH or DELETE from this client."
            raise RuntimeError(msg)
        return self.generic(
            sent.method, sent.path, sent.data, sent.content_type, sent.secure, **sent.extra
        )


class _TestClient(Protocol[_ResponseT_co]):
    """What ``assert_idempotent`` needs of a client: Django's ``Client`` and DRF's have it."""

    def post(self, path: str, data: Any = ..., **extra: Any) -> _ResponseT_co: ...
    def put(self, path: str, data: Any = ..., **extra: Any) -> _ResponseT_co: ...
    def patch(self, path: str, data: Any = ..., **extra: Any) -> _ResponseT_co: ...
    def delete(self, path: str, data: Any = ..., **extra: Any) -> _ResponseT_co: ...


def assert_idempotent(
    client: _TestClient[_ResponseT_co],
    method: str,
    path: str,
    data: Any = None,
    *,
    effect: Callable[[], object] | None = None,
    **extra: Any,
) -> tuple[_ResponseT_co, _ResponseT_co]:
    """Send a request twice with one key, and assert that the second is a replay of the first.

    ``client`` is a Django or DRF test client; ``data`` and ``extra`` (``format=``,
    ``content_type=``, ``headers=``, …) go to its ``post()``, ``put()``, ``patch()`` or
    ``delete()``. The key is a fresh UUID4, or the one given in ``headers``. The assertion holds
    if the retry has the first answer's status and body bytes and ``Idempotency-Status:
    replayed``, and if ``effect()``, called before, between and after the requests, did not
    change on the retry. Return the two responses.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's
    method = method.upper()
    if method not in UNSAFE_METHODS:
        msg = f"assert_idempotent() sends POST, PUT, PATCH or DELETE, not {method}."
        raise ValueError(msg)
    if not idempotency_settings.ENABLED:
        msg = (
            "assert_idempotent() cannot pass while IDEMPOTENCY['ENABLED'] is False "
            "(inside idempotency_disabled(), for example): no view handles keys."
        )
        raise AssertionError(msg)
    header = idempotency_settings.HEADER
    key = _given_key(header, extra)
    if key is None:
        key = str(uuid.uuid4())
        extra = _with_key(header, key, extra)
    send = {
        "POST": client.post,
        "PUT": client.put,
        "PATCH": client.patch,
        "DELETE": client.delete,
    }[method]
    # Django's delete() would send the text "None" as the body.
    args = (path,) if data is None else (path, data)

    before = effect() if effect is not None else None
    first = send(*args, **extra)
    after_first = effect() if effect is not None else None
    second = send(*args, **extra)
    after_retry = effect() if effect is not None else None

    problems = []
    if second.headers.get(STATUS_HEADER) != "replayed":
        problems.append(
            f"the retry was not replayed ({_status_of(second)}): {_why_not_replayed(first, method)}"
        )
    if second.status_code != first.status_code:
        problems.append(
            f"status: {first.status_code} the first time, {second.status_code} on the retry"
        )
    first_body, second_body = _body(first), _body(second)
    if second_body != first_body:
        problems.append(
            f"body: {_shorten(first_body)} the first time, {_shorten(second_body)} on the retry"
        )
    if after_retry != after_first:
        problems.append(
            f"effect: {before!r} before the first request, {after_first!r} after it, "
            f"{after_retry!r} after the retry"
        )
    if problems:
        lines = "\n".join(f"- {problem}" for problem in problems)
        msg = f"{method} {path} with {header}: {key} is not idempotent:\n{lines}"
        raise AssertionError(msg)
    return first, second


def _status_of(response: HttpResponseBase) -> str:
    value = response.headers.get(STATUS_HEADER)
    return f"no {STATUS_HEADER} header" if value is None else f"{STATUS_HEADER}: {value}"


def _why_not_replayed(first: HttpResponseBase, method: str) -> str:
    status = first.status_code
    if first.headers.get(STATUS_HEADER) is not None:
        return f"the first response was {status} with {_status_of(first)}"
    unstored = idempotency_settings.RETRYABLE_STATUS_CODES
    if status >= 500 or status in unstored | idempotency_settings.INVALID_REQUEST_STATUS_CODES:
        return (
            f"the first response was {status}, which is never stored (5xx, retryable and "
            "invalid-request statuses are not), so the retry ran the view again"
        )
    return (
        f"the first response was {status} with no {STATUS_HEADER} header either, so no key was "
        f"handled; is the view idempotent (IdempotentMixin or @idempotent), with {method} "
        "among its methods?"
    )


def _body(response: HttpResponseBase) -> bytes:
    """The body's bytes; a streaming body is read once and put back for the caller."""
    if isinstance(response, StreamingHttpResponse):
        body = b"".join(response.streaming_content)  # type: ignore[arg-type] # sync only
        response.streaming_content = [body]
        return body
    return response.content if isinstance(response, HttpResponse) else b""


def _shorten(body: bytes, limit: int = 200) -> str:
    return repr(body) if len(body) <= limit else f"{body[:limit]!r}… ({len(body)} bytes)"


class idempotency_disabled(TestContextDecorator):
    """Turn idempotency keys off, as ``IDEMPOTENCY["ENABLED"] = False`` does.

    Idempotent views then run as if they were not: a key is ignored, nothing is stored or
    replayed, and a request without a key is not refused. The other ``IDEMPOTENCY`` settings
    are kept. Use it as a context manager, or to decorate a test function or a
    ``unittest.TestCase`` class. Like ``override_settings``, it applies to every thread.
    """

    _override: override_settings

    def enable(self) -> None:
        current = idempotency_settings.user_settings
        self._override = override_settings(IDEMPOTENCY={**current, "ENABLED": False})
        self._override.enable()

    def disable(self) -> None:
        self._override.disable()
