"""A correlation id that follows one piece of work from a request to the log lines it causes.

The id comes from the request's ``X-Correlation-ID`` header, else its ``X-Request-ID``, else it
is made up. It is kept in a context variable while the request runs (see
:class:`CorrelationIdMiddleware`), stored with every outbox message published meanwhile, sent
with the message as ``X-Correlation-ID``, and kept with the inbox event that receives it, whose
handlers run with it bound again. Every record of the library's loggers carries it as
``correlation_id``; :class:`CorrelationIdFilter` on a handler stamps your own records too.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from django_idempotency.core.middleware import SyncAndAsyncMiddleware

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from django.http import HttpRequest, HttpResponseBase

#: The header that carries the id, read from requests and sent with outbox messages.
HEADER = "X-Correlation-ID"
#: Read when the request has no ``HEADER``: what many proxies and load balancers set.
FALLBACK_HEADER = "X-Request-ID"
#: The attribute of log records that holds the id (``None`` when there is none).
LOG_FIELD = "correlation_id"

# A received id is logged and sent on: it must be short and unable to forge a log line.
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}")
# In the order they are read.
_HEADERS = (HEADER, FALLBACK_HEADER)
_current: ContextVar[str | None] = ContextVar("django_idempotency_correlation_id", default=None)


def get_correlation_id() -> str | None:
    """Return the correlation id of the work in progress, if there is one."""
    return _current.get()


def new_correlation_id() -> str:
    """Make up a correlation id, for work that did not arrive with one."""
    return uuid.uuid4().hex


def clean(value: object) -> str | None:
    """Return ``value`` if it is acceptable as a correlation id, else ``None``."""
    if isinstance(value, str) and _VALID.fullmatch(value):
        return value
    return None


def from_headers(headers: Mapping[str, Any] | None) -> str | None:
    """Read the correlation id that ``headers`` carry, if they carry an acceptable one.

    ``headers`` may be a request's (case-insensitive) or a dict stored with an event or message.
    """
    if not headers:
        return None
    lowered = None
    for name in _HEADERS:
        value = headers.get(name)
        if value is None and isinstance(headers, dict):
            # A stored dict keeps the sender's spelling of the name; a request's headers need
            # no such search.
            if lowered is None:
                lowered = {str(key).lower(): item for key, item in headers.items()}
            value = lowered.get(name.lower())
        if (found := clean(value)) is not None:
            return found
    return None


def without_invalid(headers: Mapping[str, str]) -> dict[str, str]:
    """Return ``headers`` less the correlation id headers whose value is not acceptable.

    For headers that are stored: what is kept is read back with :func:`from_headers`.
    """
    names = {name.lower() for name in _HEADERS}
    return {
        name: value
        for name, value in headers.items()
        if name.lower() not in names or clean(value) is not None
    }


@contextlib.contextmanager
def bind(correlation_id: str | None) -> Iterator[str | None]:
    """Make ``correlation_id`` the current one inside the block (``None`` keeps the current)."""
    if correlation_id is None:
        yield _current.get()
        return
    token = _current.set(correlation_id)
    try:
        yield correlation_id
    finally:
        _current.reset(token)


class CorrelationIdFilter(logging.Filter):
    """Set ``record.correlation_id`` to the current correlation id, unless the record has one.

    The library's loggers have it already. Add it to a handler to stamp every record the handler
    sees, your own included.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, LOG_FIELD):
            setattr(record, LOG_FIELD, _current.get())
        return True


class CorrelationIdMiddleware(SyncAndAsyncMiddleware):
    """Bind the request's correlation id while it runs, and send it back in ``X-Correlation-ID``.

    Put it first in ``MIDDLEWARE``, so that whatever runs after it logs with the id.
    """

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        correlation_id = from_headers(request.headers) or new_correlation_id()
        with bind(correlation_id):
            response: HttpResponseBase = self.get_response(request)
        return _answer(response, correlation_id)

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        correlation_id = from_headers(request.headers) or new_correlation_id()
        with bind(correlation_id):
            response = await self.get_response(request)
        return _answer(response, correlation_id)


def _answer(response: HttpResponseBase, correlation_id: str) -> HttpResponseBase:
    if HEADER not in response:
        response[HEADER] = correlation_id
    return response


# The library's loggers stamp their records whatever the project's handlers are. A filter on a
# logger sees only the records logged on that very logger, hence one per logger.
LOGGERS = (
    "django_idempotency",
    "django_idempotency.inbox",
    "django_idempotency.outbox",
    "django_idempotency.client",
)
_FILTER = CorrelationIdFilter()
for _name in LOGGERS:
    logging.getLogger(_name).addFilter(_FILTER)
