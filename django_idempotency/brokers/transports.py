"""kombu's transports, made to hand on what a producer sent instead of failing on it.

kombu's Redis transport reads each list item as JSON and builds a message from it before any
callback of the consumer runs: an item that is not JSON, or JSON that is no kombu message (no
``properties``, no ``delivery_tag``, a ``body`` its ``body_encoding`` cannot decode), raises
there, in the consumer's loop, and has already left the list. The transport given here raises
:class:`UnreadableItem` with the item instead, for the consumer to keep dead.

py-amqp decodes a message's short-string properties (``message_id``, ``type``…) as UTF-8: bytes
that are not UTF-8 raise between the message's frames, the connection is lost, and the broker
delivers the message again, first, for ever. :func:`tolerant_frame_handler` replaces such a
message's properties by one header that says why, so that the consumer can keep it dead and
acknowledge it.
"""

from __future__ import annotations

import base64
import binascii
from functools import cache
from struct import pack, unpack_from
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

#: URL schemes of kombu's Redis transport.
REDIS_SCHEMES = frozenset({"redis", "rediss"})
#: URL schemes of kombu's py-amqp transport.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
#: The header that replaces the properties py-amqp cannot decode; its value says why.
UNREADABLE_PROPERTIES = "x-unreadable-properties"


class UnreadableItem(Exception):
    """A Redis list item from which no message can be made; it has left its list."""

    def __init__(self, item: Any, reason: str) -> None:
        super().__init__(reason)
        self.item, self.reason = item, reason


def tolerant_frame_handler(connection: Any, callback: Any) -> Callable[[Any], Any]:
    """py-amqp's frame handler (``amqp.Connection(frame_handler=...)``), which hands on a
    message whose properties are not UTF-8 with :data:`UNREADABLE_PROPERTIES` instead of them."""
    # Imported here: kombu brings py-amqp, and only AMQP consumers need it.
    from amqp.method_framing import frame_handler  # noqa: PLC0415

    on_frame = frame_handler(connection, callback)

    def on_frame_tolerantly(frame: tuple[int, int, Any]) -> Any:
        try:
            return on_frame(frame)
        except UnicodeDecodeError as exc:
            frame_type, channel, buf = frame
            if frame_type != 2:  # not a content header frame (AMQP 0-9-1, 4.2.6.1)
                raise
            # The message that the header belongs to is still the channel's partial one: it
            # takes this header instead, and its body frames follow as they would have.
            return on_frame((frame_type, channel, _unreadable_header(buf, exc)))

    return on_frame_tolerantly


def _unreadable_header(buf: Any, error: UnicodeDecodeError) -> bytes:
    """A content header with ``buf``'s class, weight and body size, whose one property is a
    header that says why ``buf``'s own could not be read."""
    from amqp.basic_message import Message  # noqa: PLC0415

    class_id, weight, body_size = unpack_from(">HHQ", buf, 0)
    reason = Message(application_headers={UNREADABLE_PROPERTIES: f"not UTF-8: {error}"})
    properties: bytes = reason._serialize_properties()
    return pack(">HHQ", class_id, weight, body_size) + properties


@cache
def redis_transport() -> type[Any]:
    """kombu's Redis transport, which raises ``UnreadableItem`` for an item that is no message."""
    # Imported here: kombu's Redis transport needs libraries that only Redis users install.
    from kombu.transport import redis  # noqa: PLC0415

    class Transport(redis.Transport):  # type: ignore[misc] # kombu is untyped
        def _deliver(self, message: Any, queue: str) -> None:
            problem = not_a_message(message)
            if problem is not None:
                raise UnreadableItem(message, f"the list item is not a kombu message: {problem}")
            super()._deliver(message, queue)

    return Transport


def not_a_message(item: Any) -> str | None:
    """Why kombu's virtual transports cannot make a message of ``item``, or ``None``."""
    if not isinstance(item, dict):
        return f"it is {type(item).__name__}, not an object"
    properties = item.get("properties")
    if not isinstance(properties, dict):
        return "it has no properties object"
    if properties.get("delivery_tag") is None:
        return "its properties have no delivery_tag"
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or "exchange" not in info or "routing_key" not in info:
        return "its properties have no delivery_info with an exchange and a routing_key"
    if not isinstance(item.get("headers") or {}, dict):
        return "its headers are not an object"
    return _body_problem(item.get("body"), properties.get("body_encoding"))


def _body_problem(body: Any, encoding: Any) -> str | None:
    if body is not None and not isinstance(body, str):
        return "its body is not a string"
    if encoding not in (None, "", "base64"):
        return f"its body_encoding {encoding!r} is not known"
    if body and encoding == "base64":
        try:
            base64.b64decode(body.encode(), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError):
            return "its body is not base64"
    return None
