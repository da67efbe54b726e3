"""What a consumer takes from a broker's message: every value checked before it reaches a database.

A producer may send whatever its broker carries: a ``message_id`` that is no text, a ``type``
holding a NUL character or a lone surrogate (py-amqp decodes the bytes of a property with
``surrogatepass``, and no UTF-8 column takes the result), a body that is not JSON, or JSON nested
deeper than a database stores. :func:`read` turns any message into a :class:`Delivery` that can
be recorded as it stands: an event to process, or one to keep dead, with the reason and as much
of the body as can be kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_idempotency.brokers.transports import UNREADABLE_PROPERTIES
from django_idempotency.core.bodies import UnfitJSON, load_json
from django_idempotency.core.text import mended, storable

if TYPE_CHECKING:
    from kombu.message import Message

#: Why a message without an id is refused.
NO_MESSAGE_ID = (
    "the message has no message_id property: without the producer's id a redelivery cannot be "
    "told from a new message"
)
#: The longest message id and type an inbox event holds.
MAX_LENGTH = 255
#: How much of a body that cannot be stored as JSON a refused event keeps, in characters.
KEPT_BODY = 10_000
#: The content types read as JSON; a message with none is read as JSON too.
JSON_TYPES = frozenset({"", "application/json", "text/json"})


@dataclass(frozen=True)
class Delivery:
    """A message as an inbox event: what it is recorded as, and why it is refused, if it is."""

    event_id: str | None  # the producer's message_id; None: keyed by the payload's hash
    event_type: str
    headers: dict[str, str]
    payload: Any
    body: bytes  # as it came, for a refusal that keeps what it can of it
    redelivered: bool
    refusal: str | None = None  # set: the event is kept dead, with this reason


def read(message: Message) -> Delivery:
    """The delivery that ``message`` is recorded as; never raises."""
    properties = _mapping(message.properties)
    delivery_info = _mapping(message.delivery_info)
    headers = _headers(message.headers)
    refusals: list[str] = []
    if unreadable := headers.pop(UNREADABLE_PROPERTIES, None):
        refusals.append(f"the message's properties cannot be read ({unreadable})")

    event_id: str | None = None
    message_id = properties.get("message_id")
    if message_id is None or message_id == "":
        refusals.append(NO_MESSAGE_ID)
    elif problem := _text_problem(message_id):
        refusals.append(f"the message's message_id {problem}")
    else:
        event_id = str(message_id)

    event_type = properties.get("type") or delivery_info.get("routing_key") or ""
    if problem := _text_problem(event_type):
        refusals.append(f"the message's type {problem}")
        event_type = mended(event_type) if isinstance(event_type, str) else ""

    payload, problem = _body(message)
    if problem:
        refusals.append(problem)
    return Delivery(
        event_id=event_id,
        event_type=str(event_type),
        headers=headers,
        payload=payload,
        body=_bytes(message.body),
        redelivered=_redelivered(delivery_info),
        refusal="; ".join(refusals) or None,
    )


def kept(body: Any) -> dict[str, str]:
    """What a refused event keeps of a body it cannot store as JSON: text a person can read,
    and the SHA-256 of the bytes as they came."""
    raw = _bytes(body)
    return {
        "body": mended(raw[: KEPT_BODY * 4].decode(errors="replace")[:KEPT_BODY]),
        "body_sha256": hashlib.sha256(raw).hexdigest(),
    }


def _text_problem(value: Any, max_length: int = MAX_LENGTH) -> str | None:
    """Why ``value`` cannot be an event's id or type, or ``None`` if it can."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # a JSON producer's (on Redis) number
    if not isinstance(value, str):
        return f"is not text but {type(value).__name__}"
    if "\x00" in value:
        return "holds a NUL character"
    if not storable(value):
        return "is not valid Unicode (a lone surrogate)"
    if len(value) > max_length:
        return f"is longer than {max_length} characters"
    return None


def _headers(headers: Any) -> dict[str, str]:
    """The headers an event keeps: text or numbers, named by text, that every database takes."""
    kept_headers: dict[str, str] = {}
    for name, value in _mapping(headers).items():
        if not isinstance(name, str) or isinstance(value, bool):
            continue
        if isinstance(value, str | int | float) and storable(name) and storable(str(value)):
            kept_headers[name] = str(value)
    return kept_headers


def _body(message: Message) -> tuple[Any, str | None]:
    """The body as JSON, or what is kept of it and why it cannot be read."""
    body = _bytes(message.body)
    content_type = str(message.content_type or "").split(";")[0].strip().lower()
    if content_type not in JSON_TYPES and not content_type.endswith("+json"):
        problem: str | None = f"the body is {content_type}, not JSON"
    else:
        payload, problem = _json(body)
    return (kept(body), problem) if problem else (payload, None)


def _json(body: bytes) -> tuple[Any, str | None]:
    try:
        text = body.decode()
    except UnicodeDecodeError:
        return None, "the body is not UTF-8"
    try:
        payload = load_json(text)
    except UnfitJSON as exc:
        return None, f"the body {exc}"
    except ValueError:
        return None, "the body is not JSON"
    # JSON escapes are the only way for NUL or a lone surrogate into a decoded document.
    if "\\u" in text and not _all_storable(payload):
        return None, "the body holds a NUL character or a lone surrogate in a JSON string"
    return payload, None


def _all_storable(value: Any) -> bool:
    """Whether every string of a JSON ``value``, object keys included, is storable."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if not storable(node):
                return False
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return True


def _redelivered(delivery_info: dict[str, Any]) -> bool:
    """Whether the broker delivered the message before: AMQP's flag, or SQS's receive count."""
    if delivery_info.get("redelivered"):
        return True
    sqs = _mapping(delivery_info.get("sqs_message"))
    count = _mapping(sqs.get("Attributes")).get("ApproximateReceiveCount", "1")
    try:
        return int(count) > 1
    except (TypeError, ValueError):
        return False


def _bytes(body: Any) -> bytes:
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    return b"" if body is None else str(body).encode("utf-8", "surrogatepass")


def _mapping(value: Any) -> dict[Any, Any]:
    return value if isinstance(value, dict) else {}
