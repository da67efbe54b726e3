"""One attempt at a job of the retry queue: claimed and counted, or dead; then failed or done.

The inbox and the outbox take these steps on their own tables, each described by a
:class:`JobTable`. Where they differ it is on purpose: the inbox claims one event by its id (a
trigger names it) and runs its handler in the attempt's transaction, holding the row's lock as
the attempt's sign of life; the outbox claims a batch of due messages and sends them with no
transaction open, its lease keeping the batch.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django.db.models import Case, F, Value, When

from django_idempotency.core.text import mended
from django_idempotency.core.transactions import write_transaction
from django_idempotency.queue.schedule import RetrySchedule, error_text, stopped_text

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from django.db.models import Model, QuerySet

_M = TypeVar("_M", bound="Model")


@dataclass(frozen=True)
class JobTable(Generic[_M]):
    """What the queue's steps need to know of a table whose rows are jobs.

    Its rows have ``status``, ``attempts``, ``next_attempt_at`` and ``last_error``, and may
    have ``last_traceback``.
    """

    model: type[_M]
    settings: str  # "INBOX": its schedule is read from INBOX_MAX_ATTEMPTS and the like
    runner: str  # what runs an attempt, as a dead job's error names it: "worker", "relay"
    attempting: str  # a job's status while an attempt runs
    failed: str  # a failed job's status: due again at its retry time
    dead: str

    @property
    def keeps_traceback(self) -> bool:
        """Whether its rows keep a failure's traceback, in ``last_traceback``."""
        return any(column.name == "last_traceback" for column in self.model._meta.concrete_fields)

    def schedule(self) -> RetrySchedule:
        """The table's retry schedule, read from the settings now."""
        return RetrySchedule.from_settings(self.settings)

    @property
    def marks_attempts(self) -> bool:
        """Whether a running attempt clears the row's error, its only sign: a job's status
        while it runs is its status while it waits for its retry."""
        return self.attempting == self.failed


@dataclass
class Claimed(Generic[_M]):
    """What a claim took: jobs whose attempt it counted, and jobs out of attempts, now dead."""

    started: list[_M] = field(default_factory=list)
    dead: list[_M] = field(default_factory=list)


def claim(
    table: JobTable[_M],
    candidates: QuerySet[_M],
    *,
    using: str,
    until: Callable[[_M], datetime],
    limit: int | None = None,
    waiting: QuerySet[_M] | None = None,
    starting: Callable[[_M], None] | None = None,
    on_dead: Callable[[_M, str], None],
) -> Claimed[_M]:
    """Claim up to ``limit`` of ``candidates`` that no attempt holds; count an attempt for each.

    A job out of attempts is dead instead: ``on_dead`` is given it and the status it left, in
    the claim's transaction, to report once that commits. ``until(job)`` is when a started job
    is due again should its attempt never finish. ``starting`` is given each job before its
    attempt is counted. ``waiting`` is read, waiting for its locks, when none of ``candidates``
    was free: rows that something other than an attempt locks for a moment.
    """
    schedule = table.schedule()
    claimed = Claimed[_M]()
    with write_transaction(table.model, using):
        jobs = list(candidates.select_for_update(skip_locked=True)[:limit])
        if not jobs and waiting is not None:
            jobs = list(waiting.select_for_update()[:limit])
        for job in jobs:
            row: Any = job
            (claimed.dead if schedule.spent(row.attempts) else claimed.started).append(job)
        if claimed.dead:
            _dead_letter(table, claimed.dead, using, on_dead)
        if claimed.started:
            _start(table, claimed.started, using, until, starting)
    return claimed


def _dead_letter(
    table: JobTable[_M], jobs: list[_M], using: str, on_dead: Callable[[_M, str], None]
) -> None:
    fields = ["status", "next_attempt_at", "last_error"]
    if table.keeps_traceback:
        fields.append("last_traceback")
    for job in jobs:
        row: Any = job
        from_state = row.status
        # Still as the claim of its last attempt left it (where the status cannot tell, with
        # no error since): its runner died in that attempt.
        if row.status == table.attempting and not (table.marks_attempts and row.last_error):
            row.last_error = stopped_text(table.runner, row.attempts)
            if table.keeps_traceback:
                row.last_traceback = ""
        row.status, row.next_attempt_at = table.dead, None
        on_dead(job, from_state)
    table.model._default_manager.using(using).bulk_update(jobs, fields)


def _start(
    table: JobTable[_M],
    jobs: list[_M],
    using: str,
    until: Callable[[_M], datetime],
    starting: Callable[[_M], None] | None,
) -> None:
    due_again: dict[datetime, list[Any]] = {}
    for job in jobs:
        if starting is not None:
            starting(job)
        count_attempt(table, job, until)
        row: Any = job
        due_again.setdefault(row.next_attempt_at, []).append(row.pk)
    # The job keeps the previous attempt's error in memory, as what runs the attempt is told.
    cleared = {"last_error": ""} if table.marks_attempts else {}
    rows = table.model._default_manager.using(using)
    for next_attempt_at, pks in due_again.items():  # one statement for a batch's common time
        rows.filter(pk__in=pks).update(
            status=table.attempting,
            attempts=F("attempts") + 1,
            next_attempt_at=next_attempt_at,
            **cleared,
        )


def count_attempt(table: JobTable[_M], job: _M, until: Callable[[_M], datetime]) -> None:
    """Set on ``job`` the attempt that starts: counted before it runs, so that a job whose runner
    dies every time still runs out of attempts; due again at ``until(job)``, should it never
    finish."""
    row: Any = job
    row.status = table.attempting
    row.attempts += 1
    row.next_attempt_at = until(job)


def fail(
    table: JobTable[_M],
    job: _M,
    error: Exception,
    *,
    retry_from: datetime | None = None,
    random: Callable[[], float] = random.random,
) -> bool:
    """Set on ``job`` what its attempt that failed with ``error`` leaves; return whether it is dead.

    Dead once its attempts ran out or it raised a ``PermanentError``; else failed, due again
    after a retry delay from ``retry_from``, or at the time its claim set.
    """
    row: Any = job
    schedule = table.schedule()
    dead = schedule.gives_up(row.attempts, error)
    if dead:
        row.status, row.next_attempt_at = table.dead, None
    else:
        row.status = table.failed
        if retry_from is not None:
            delay = schedule.retry_delay(row.attempts, random)
            row.next_attempt_at = retry_from + timedelta(seconds=delay)
    row.last_error = error_text(error)
    if table.keeps_traceback:
        row.last_traceback = mended("".join(traceback.format_exception(error)))
    return dead


def record(table: JobTable[_M], job: _M, using: str, *fields: str) -> bool:
    """Write ``fields`` of ``job``, unless another runner took it over since this attempt was
    claimed; return whether they were written."""
    row: Any = job
    mine = table.model._default_manager.using(using).filter(
        pk=row.pk, status=table.attempting, attempts=row.attempts
    )
    return mine.update(**{name: getattr(row, name) for name in fields}) > 0


def give_back(table: JobTable[_M], jobs: list[_M], using: str, now: datetime) -> None:
    """Give back jobs claimed but not run: due ``now``, their attempt not counted, with the error
    of the attempt before it."""
    for job in jobs:
        row: Any = job
        back = {"last_error": row.last_error} if table.marks_attempts else {}
        table.model._default_manager.using(using).filter(
            pk=row.pk, status=table.attempting, attempts=row.attempts
        ).update(attempts=F("attempts") - 1, next_attempt_at=now, **back)


def errors_back(table: JobTable[_M], jobs: list[_M]) -> dict[str, Any]:
    """The change that gives jobs whose attempts succeeded the errors their claim cleared: none
    when they had none, as most do."""
    if not table.marks_attempts:
        return {}
    rows: list[Any] = jobs
    errors = [When(pk=row.pk, then=Value(row.last_error)) for row in rows if row.last_error]
    return {"last_error": Case(*errors, default=Value(""))} if errors else {}
