"""Idempotent tasks for Django's Tasks framework: a task run twice has its effect once.

Django's Tasks framework (``django.tasks`` from Django 6.0; the ``django_tasks`` backport before
it) runs a task at least once as far as a project can tell: a caller that enqueues twice (a
retried request, a cron line that fires twice, an operator who enqueues a stuck task again), a
worker killed mid-task whose task is enqueued again. Declare the task with ``idempotent_task``
rather than ``@task`` and each run is an operation of the engine that runs idempotent views and
idempotent Celery tasks (``django_idempotency.celery``), with the same contract:

- the key is the caller's ``idempotency_key=`` keyword argument, or what the task's ``key``
  function makes of its arguments, scoped to the task's module path (and a tenant);
- **atomic** mode (the default): the claim, the body's writes and its stored result commit in
  one transaction; **lease** mode: the claim commits first, with a lease, and the result is
  stored by a completion fenced by the lease version;
- a second run returns the first run's stored result; a run whose lease was taken over writes
  nothing.

What differs is how a run that finds its key busy runs again: the framework has no retries, so
with ``on_busy="retry"`` the run enqueues the task again, to run ``busy_countdown`` seconds later,
on a backend that can defer (``django_tasks_db``'s can; the immediate backend cannot, and the
run then fails with ``TaskInProgress`` at once).
"""

from __future__ import annotations

import functools
import importlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from django_idempotency.core import optional
from django_idempotency.core.task_runs import OnBusy, TaskOptions, TaskRun, declare, signature
from django_idempotency.exceptions import TaskInProgress

__all__ = ["idempotent_task"]

if TYPE_CHECKING:
    from collections.abc import Callable

    from django_idempotency.conf import Mode

#: The argument the framework passes a task that takes its context; the adapter always does.
CONTEXT = "context"


def _framework() -> Any:
    """Django's own ``django.tasks`` (6.0 and later), else the backport, ``django_tasks``."""
    if optional.installed("django.tasks"):
        return importlib.import_module("django.tasks")
    with optional.requires("tasks", __name__):
        return importlib.import_module("django_tasks")


#: The framework's package: ``django.tasks`` or ``django_tasks``.
framework = _framework()


def idempotent_task(
    func: Callable[..., Any] | None = None,
    *,
    key: Callable[..., Any] | None = None,
    tenant: Callable[..., Any] | None = None,
    mode: Mode = "atomic",
    ttl: timedelta | float | None = None,
    wait_timeout: float | None = None,
    lease_timeout: timedelta | float | None = None,
    recover: Callable[..., Any] | None = None,
    on_busy: OnBusy = "retry",
    busy_countdown: float | None = None,
    takes_context: bool = False,
    **task_options: Any,
) -> Any:
    """Declare a task (as the framework's ``@task`` does) whose every key runs its body once.

    ``key(*args, **kwargs)`` makes the key from the task's arguments; without it, callers pass
    ``idempotency_key=``. ``tenant(*args, **kwargs)`` adds a tenant to the key's scope. Other
    keyword arguments (``priority``, ``queue_name``, ``backend``) go to the framework; with
    ``takes_context=True`` the body gets the task's context first, as with ``@task``.
    """
    options = TaskOptions(
        key=key,
        tenant=tenant,
        mode=mode,
        ttl=ttl,
        wait_timeout=wait_timeout,
        lease_timeout=lease_timeout,
        recover=recover,
        on_busy=on_busy,
        busy_countdown=busy_countdown,
    )

    def declare_task(body: Callable[..., Any]) -> Any:
        # The framework's own name for the task, by which its workers import it.
        name = f"{body.__module__}.{body.__qualname__}"
        takes_key = declare(name, options, body)

        # The wrapper keeps the body's module and name: a worker imports the task by them.
        @functools.wraps(body)
        def run(context: Any, *args: Any, **kwargs: Any) -> Any:
            # The wrapper always takes the context (it enqueues a busy run again); the body
            # gets it if it asked to.
            if takes_context:
                call = functools.partial(body, context, *args)
            else:
                call = functools.partial(body, *args)
            task_run = DjangoTaskRun(
                name, options, args, kwargs, call, context=context, takes_key=takes_key
            )
            return task_run.execute()

        # The framework checks that a task taking its context names it first.
        run.__signature__ = signature(body, first=None if takes_context else CONTEXT)  # type: ignore[attr-defined]
        return framework.task(takes_context=True, **task_options)(run)

    return declare_task if func is None else declare_task(func)


class DjangoTaskRun(TaskRun):
    """One run of an idempotent task of Django's Tasks framework."""

    def __init__(
        self,
        name: str,
        options: TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: Callable[..., Any],
        *,
        context: Any,
        takes_key: bool = False,
    ) -> None:
        self.context = context
        task = context.task_result.task
        super().__init__(name, options, args, kwargs, body, sender=task, takes_key=takes_key)

    def retry(self, countdown: float, busy: TaskInProgress) -> Any:
        """Enqueue the task again, with the same arguments, to run ``countdown`` seconds later;
        this run fails with ``TaskInProgress``, which names the new run's result."""
        result = self.context.task_result
        task = result.task
        if not task.get_backend().supports_defer:
            raise busy
        later = timezone.now() + timedelta(seconds=countdown)
        again = task.using(run_after=later).enqueue(*result.args, **result.kwargs)
        msg = f"{busy} It runs again in {countdown:g} s, as the task result {again.id}."
        raise TaskInProgress(msg) from busy
