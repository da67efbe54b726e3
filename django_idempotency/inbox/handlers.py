"""The registry of inbox handlers, one per (source, event type)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from collections.abc import Callable

    from django_idempotency.models import InboxEvent

    Handler = Callable[[InboxEvent], object]

#: Registers a handler for every event type of a source that has no handler of its own.
ANY_TYPE = "*"

_registry: dict[tuple[str, str], Handler] = {}


def inbox_handler(source: str, *event_types: str) -> Callable[[Handler], Handler]:
    """Register the decorated function to process ``source``'s events of ``event_types``.

    The function receives the ``InboxEvent`` and runs in the transaction that marks it processed:
    raise to roll its writes back and have the event retried. Import the module that defines it
    in your ``AppConfig.ready()``.
    """
    if not event_types:
        msg = "inbox_handler() needs the event types it handles, or ANY_TYPE."
        raise TypeError(msg)

    def register(handler: Handler) -> Handler:
        for event_type in event_types:
            register_handler(source, event_type, handler)
        return handler

    return register


def register_handler(source: str, event_type: str, handler: Handler) -> None:
    """Process ``source``'s events of ``event_type`` (or of ``ANY_TYPE``) with ``handler``."""
    current = _registry.get((source, event_type))
    # A module imported twice registers equal functions again: that is no conflict.
    if current is not None and _name(current) != _name(handler):
        msg = (
            f"{_name(handler)} cannot handle {source!r} events of type {event_type!r}: "
            f"{_name(current)} already does."
        )
        raise ImproperlyConfigured(msg)
    _registry[source, event_type] = handler


def get_handler(source: str, event_type: str) -> Handler | None:
    """The handler of ``source``'s events of ``event_type``, if one is registered."""
    return _registry.get((source, event_type)) or _registry.get((source, ANY_TYPE))


def handles_source(source: str) -> bool:
    """Whether any handler is registered for ``source``'s events."""
    return any(registered == source for registered, _type in _registry)


def unregister(source: str, *event_types: str) -> None:
    """Forget the handlers of ``source``'s ``event_types``: for tests.

    A handler is registered for a source and an event type, a dispatcher for a topic alone:
    hence the source here, which ``outbox.dispatchers.unregister`` has no need of.
    """
    for event_type in event_types:
        _registry.pop((source, event_type), None)


def _name(handler: Handler) -> str:
    return f"{handler.__module__}.{handler.__qualname__}"
