"""What is stored of a response and how it is replayed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse

if TYPE_CHECKING:
    from django_idempotency.core.rows import StoredResponse

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
