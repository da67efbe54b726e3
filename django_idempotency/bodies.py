"""What the library reads of a request body: JSON within a depth limit, and only a whole body."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.handlers.wsgi import WSGIRequest

if TYPE_CHECKING:
    from django.http import HttpRequest

#: The deepest nesting of JSON arrays and objects that is parsed: ``[]`` is 1 level, ``{"a": []}``
#: 2. Parsing and canonicalizing JSON recurse once per level or more, so a body a few thousand
#: levels deep (a few kilobytes) would exhaust Python's recursion limit (1,000) mid-request. No
#: real request or webhook comes near 64 levels.
MAX_JSON_DEPTH = 64

_Value = TypeVar("_Value")


class JSONTooDeep(ValueError):
    """The JSON document is nested deeper than ``MAX_JSON_DEPTH``."""

    def __init__(self) -> None:
        super().__init__(f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels")


def check_json_depth(value: _Value) -> _Value:
    """Return a parsed JSON ``value``; raise ``JSONTooDeep`` if it is nested too deeply."""
    # Depth first with a stack of its own: the check itself must not recurse.
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > MAX_JSON_DEPTH:
            raise JSONTooDeep
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


def load_json(data: bytes | str) -> Any:
    """``json.loads`` within ``MAX_JSON_DEPTH``: raise ``ValueError`` if ``data`` is not JSON,
    ``JSONTooDeep`` (a ``ValueError``) if it is nested too deeply."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise JSONTooDeep from None
    return check_json_depth(value)


def length_unknown(request: HttpRequest) -> bool:
    """Whether the request has a body that Django cannot read whole.

    Under WSGI, Django reads exactly ``Content-Length`` bytes of a body, and none without it: a
    body sent with ``Transfer-Encoding: chunked`` reads as empty. (Under ASGI the server hands
    Django the whole body.)
    """
    return (
        isinstance(request, WSGIRequest)
        and "HTTP_TRANSFER_ENCODING" in request.META
        and not request.META.get("CONTENT_LENGTH")
    )
