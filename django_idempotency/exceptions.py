"""Exceptions that users' own code raises to tell the library something."""

from __future__ import annotations

__all__ = ["PermanentError"]


class PermanentError(Exception):
    """Trying again cannot succeed: raised by an inbox handler or an outbox dispatcher.

    The event or message is marked dead at once, its error kept for a person to read, instead
    of being retried until its attempts run out. Any other exception is retried with backoff.
    """
