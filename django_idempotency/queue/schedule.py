"""The durable retry queue that the inbox and the outbox share: one row per job, due at its
``next_attempt_at``.

Each attempt is counted before it runs, so that a job whose runner dies every time still runs
out of attempts. A failed attempt is retried after a delay drawn with exponential backoff and
full jitter, kept in the row; once its attempts run out, or it raised
:class:`~django_idempotency.exceptions.PermanentError`, the job is dead and waits for a person.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from django_idempotency.backoff import full_jitter
from django_idempotency.conf import idempotency_settings
from django_idempotency.core.text import mended
from django_idempotency.exceptions import PermanentError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from datetime import datetime, timedelta

    from django.db.models import Model, QuerySet

_M = TypeVar("_M", bound="Model")

#: The most of an error's text that a row keeps as its ``last_error``.
ERROR_MAX_LENGTH = 2_000


@dataclass(frozen=True)
class RetrySchedule:
    """How many attempts a job gets, and how long it waits after each that fails.

    Not the client's ``RetryPolicy``, which retries one HTTP request within a call.
    """

    max_attempts: int
    delay: timedelta  # the bound of the first wait; it doubles with each failed attempt
    max_delay: timedelta

    @classmethod
    def from_settings(cls, queue: str) -> RetrySchedule:
        """``queue``'s schedule ("INBOX" or "OUTBOX"): its ``<queue>_MAX_ATTEMPTS``,
        ``<queue>_RETRY_DELAY`` and ``<queue>_RETRY_MAX_DELAY`` settings, read now."""
        return cls(
            idempotency_settings.get(f"{queue}_MAX_ATTEMPTS"),
            idempotency_settings.get(f"{queue}_RETRY_DELAY"),
            idempotency_settings.get(f"{queue}_RETRY_MAX_DELAY"),
        )

    def spent(self, attempts: int) -> bool:
        """Whether a job that has started ``attempts`` attempts may start no more."""
        return attempts >= self.max_attempts

    def gives_up(self, attempts: int, error: Exception) -> bool:
        """Whether a job whose attempt ``attempts`` failed with ``error`` is dead."""
        # A PermanentError is the job saying that a retry cannot help.
        return self.spent(attempts) or isinstance(error, PermanentError)

    def retry_delay(self, attempt: int, random: Callable[[], float] = random.random) -> float:
        """Seconds to wait after attempt ``attempt`` fails, drawn with full jitter."""
        base, cap = self.delay.total_seconds(), self.max_delay.total_seconds()
        return full_jitter(attempt, base, cap, random)


def due(rows: QuerySet[_M], now: datetime) -> QuerySet[_M]:
    """The rows of ``rows`` due at ``now`` that no attempt holds, locked as they are read.

    Read them in a :func:`~django_idempotency.core.transactions.write_transaction`, in the order
    that the table's due index serves. A locked row is mid-attempt: skipped, not waited for.
    """
    return rows.select_for_update(skip_locked=True).filter(next_attempt_at__lte=now)


def change_unclaimed(
    selected: QuerySet[_M], changes: Mapping[str, Any], *fields: str
) -> list[dict[str, Any]]:
    """Make a person's ``changes`` to the rows of ``selected`` that no attempt holds.

    Return the ``pk``, ``status`` and ``fields`` of each row changed, as they were. Call it in
    a :func:`~django_idempotency.core.transactions.write_transaction`: a locked row is mid-attempt,
    and skipping it leaves that attempt to finish.
    """
    rows = list(selected.select_for_update(skip_locked=True).values("pk", "status", *fields))
    unclaimed = selected.model._default_manager.using(selected.db)
    unclaimed.filter(pk__in=[row["pk"] for row in rows]).update(**changes)
    return rows


def error_text(error: BaseException) -> str:
    """What a row keeps of ``error``: its type and its message, bounded, as text every database
    stores."""
    return mended(f"{type(error).__qualname__}: {error}"[:ERROR_MAX_LENGTH])


def stopped_text(runner: str, attempt: int) -> str:
    """The error of a job dead with no outcome recorded: its ``runner`` died every attempt."""
    return f"The {runner} stopped during attempt {attempt}."
