"""What is stored of a response and how it is replayed; the answer when the database fails."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from django.db import InterfaceError, OperationalError, connections
from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse

from django_idempotency import problems

if TYPE_CHECKING:
    from django_idempotency.core.store import StoredResponse

logger = logging.getLogger("django_idempotency")

STATUS_HEADER = "Idempotency-Status"
REPLAYED_HEADER = "Idempotent-Replayed"

# Never stored nor replayed: hop-by-hop headers (RFC 9110 section 7.6.1), headers a server
# recomputes, and our own.
_UNSTORED_HEADERS = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "content-length", "date", "server",
        "set-cookie", STATUS_HEADER.lower(), REPLAYED_HEADER.lower(),
    }
)  # fmt: skip


# Connection lost, server shutting down, deadlock, serialization failure: errors of the
# database's operation rather than of the code, worth a retry.
DATABASE_UNAVAILABLE = (OperationalError, InterfaceError)


def unavailable_response(*, rolled_back: bool) -> HttpResponse:
    """Log the current database error and answer 503 ``idempotency.unavailable``.

    ``rolled_back`` says whether the engine's transaction held everything the view did, so
    that the client can be told nothing was kept.
    """
    logger.warning("database unavailable", exc_info=True)
    # Under ATOMIC_REQUESTS the request's own transaction is still open on a dead connection:
    # mark it for rollback, or Django would try to commit it and answer 500 after all.
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            connection.set_rollback(True)
    detail = "The database could not complete the request"
    detail += "; nothing was kept. Retry it." if rolled_back else ". Retry it."
    return problems.problem_response(problems.UNAVAILABLE, detail)


def capture(response: HttpResponseBase) -> tuple[list[tuple[str, str]], bytes]:
    """Return the headers and body to store, reading a streaming body into memory once."""
    if callable(getattr(response, "render", None)):
        response.render()  # type: ignore[attr-defined]
    if isinstance(response, StreamingHttpResponse):
        body = b"".join(response.streaming_content)  # type: ignore[arg-type]
        response.streaming_content = [body]
    else:
        body = response.content  # type: ignore[attr-defined]
    headers = [
        (name, value) for name, value in response.items() if name.lower() not in _UNSTORED_HEADERS
    ]
    return headers, body


def replay_response(stored: StoredResponse) -> HttpResponse:
    response = HttpResponse(stored.body, status=stored.status)
    # The stored headers say the body's type, if the view gave one: never Django's default.
    del response["Content-Type"]
    for name, value in stored.headers:
        response[name] = value
    response[STATUS_HEADER] = "replayed"
    response[REPLAYED_HEADER] = "true"
    return response
