"""Exceptions that users' own code raises to tell the library something, and those an idempotent
task raises, whichever adapter declared it."""

from __future__ import annotations

__all__ = [
    "PermanentError",
    "TaskInProgress",
    "TaskKeyInvalid",
    "TaskKeyMissing",
    "TaskPayloadMismatch",
]


class PermanentError(Exception):
    """Trying again cannot succeed: raised by an inbox handler or an outbox dispatcher.

    The event or message is marked dead at once, its error kept for a person to read, instead
    of being retried until its attempts run out. Any other exception is retried with backoff.
    """


class TaskKeyMissing(ValueError):
    """The task has no ``key`` function and was sent without ``idempotency_key=``."""


class TaskKeyInvalid(ValueError):
    """The task's key is not a non-empty string (or integer)."""


class TaskPayloadMismatch(Exception):
    """The key was used before with other arguments: the body does not run."""


class TaskInProgress(Exception):
    """Another run holds the key and did not finish in time (and ``on_busy="skip"`` was not
    asked for, or the task's framework could not run it again later)."""
