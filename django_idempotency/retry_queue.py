"""The durable retry queue that the inbox and the outbox share: one row per job, due at its
``next_attempt_at``.

A failed attempt leaves the job's error in its row, bounded here once for both tables.
"""

from __future__ import annotations

#: The most of an error's text that a row keeps as its ``last_error``.
ERROR_MAX_LENGTH = 2_000


def error_text(error: BaseException) -> str:
    """What a row keeps of ``error``: its type and its message, bounded."""
    return f"{type(error).__qualname__}: {error}"[:ERROR_MAX_LENGTH]
