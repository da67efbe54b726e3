"""What the library reads of a request body: standard JSON within a depth limit, and only a
whole body."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.handlers.wsgi import WSGIRequest

from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest

_Value = TypeVar("_Value")


class UnfitJSON(ValueError):
    """JSON that Python reads but that the library does not pass on; the message completes
    "The JSON body …" and holds nothing of the body."""


class JSONTooDeep(UnfitJSON):
    """The JSON document is nested deeper than the ``MAX_JSON_DEPTH`` setting allows."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"is nested deeper than {limit} levels")


class JSONNotStandard(UnfitJSON):
    """The document holds ``NaN``, ``Infinity`` or ``-Infinity``, or a number beyond a double's
    range (such as ``1e400``, which Python reads as infinity)."""

    def __init__(self, value: str) -> None:
        super().__init__(f"holds {value}, which is not a JSON number (RFC 8259)")


def max_json_depth() -> int:
    """The deepest nesting of JSON arrays and objects that is read: the ``MAX_JSON_DEPTH``
    setting. ``[]`` is 1 level, ``{"a": []}`` 2."""
    return idempotency_settings.MAX_JSON_DEPTH


def check_json_depth(value: _Value) -> _Value:
    """Return a parsed JSON ``value``; raise ``JSONTooDeep`` if it is nested deeper than the
    ``MAX_JSON_DEPTH`` setting allows."""
    limit = max_json_depth()
    # Depth first with a stack of its own: the check itself must not recurse.
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            raise JSONTooDeep(limit)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


def _refuse_constant(name: str) -> Any:
    # Python's json module reads NaN and ±Infinity, which RFC 8259 §6 leaves out of JSON: other
    # parsers (DRF's among them) refuse them, and PostgreSQL's jsonb would refuse the write.
    raise JSONNotStandard(name)


def _finite_float(text: str) -> float:
    # RFC 8259 §6 lets a parser limit the range of numbers: one beyond a double's reads as
    # infinity, which json.dumps then writes as the Infinity above.
    value = float(text)
    if math.isinf(value):
        raise JSONNotStandard("a number beyond the range of a double")
    return value


def load_json(data: bytes | str) -> Any:
    """``json.loads`` of standard JSON: raise ``ValueError`` if ``data`` is not JSON,
    ``JSONNotStandard`` if it holds ``NaN`` or an infinity, ``JSONTooDeep`` if it is nested deeper
    than the ``MAX_JSON_DEPTH`` setting allows (both ``ValueError`` too)."""
    try:
        value = json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise JSONTooDeep(max_json_depth()) from None
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
