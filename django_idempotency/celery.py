"""Idempotent Celery tasks: a task delivered twice has its effect once.

Celery delivers at least once: a worker that dies under ``acks_late``, a producer that sends
twice after a timeout, a broker's visibility timeout, beat firing on two schedulers. Decorate
the task with ``idempotent_task`` and each delivery is an operation of the engine that runs
idempotent views: it claims the task's key in the key table first, as a view's request does:

- **atomic** (the default): the claim, the body's database writes and its stored result commit
  in one transaction. A duplicate returns the stored result without running the body; a body
  that raises rolls everything back, the key with it, so Celery's retry runs it again.
- **lease**, for bodies whose effect leaves the database (an email, a card charge): the claim
  commits first with a lease that is renewed while the body runs; the result is stored by a
  completion fenced by the lease version. A delivery whose worker died leaves a lease that runs
  out; the next delivery (or the sweeper) takes it over, after the task's ``recover`` hook, if
  any, said whether the effect happened.

The key is the caller's ``idempotency_key=`` keyword argument, or what the task's ``key``
function makes of the task's arguments. It is scoped to the task's name (and a tenant, if the
task names one); the arguments' canonical JSON is the fingerprint. Key rows carry the method
``TASK`` and the task's name as their route, so the admin lists them beside the request keys.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from django_idempotency.core import correlation, deprecation, optional
from django_idempotency.core.task_runs import OnBusy, TaskOptions, TaskRun, declare, signature

__all__ = ["idempotent_task"]

with optional.requires("celery", __name__):
    from celery import shared_task

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta

    from celery import Task

    from django_idempotency.conf import Mode
    from django_idempotency.exceptions import (  # noqa: F401 - deprecated here
        TaskInProgress,
        TaskKeyInvalid,
        TaskKeyMissing,
        TaskPayloadMismatch,
    )
else:
    # Their one home is django_idempotency.exceptions, which Django's Tasks framework's adapter
    # shares.
    __getattr__ = deprecation.moved(
        __name__,
        dict.fromkeys(
            ("TaskInProgress", "TaskKeyInvalid", "TaskKeyMissing", "TaskPayloadMismatch"),
            "django_idempotency.exceptions",
        ),
    )


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
    **task_options: Any,
) -> Any:
    """Declare a Celery task (as ``shared_task`` does) whose every key runs its body once.

    ``key(*args, **kwargs)`` makes the key from the task's arguments; without it, callers pass
    ``idempotency_key=``. ``tenant(*args, **kwargs)`` adds a tenant to the key's scope. Other
    keyword arguments (``name``, ``acks_late``, ``autoretry_for``, ``bind``…) go to Celery.
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
    # The wrapper is always bound (it needs the task); the body gets it if it asked to.
    bind = bool(task_options.pop("bind", False))

    def declare_task(body: Callable[..., Any]) -> Any:
        # Celery's own default name; the task object would say it only once its app is finalized.
        name = task_options.get("name") or f"{body.__module__}.{body.__name__}"
        takes_key = declare(name, options, body)

        @functools.wraps(body)
        def run(task: Task, *args: Any, **kwargs: Any) -> Any:
            call = functools.partial(body, task, *args) if bind else functools.partial(body, *args)
            with correlation.bind(_correlation_id(task)):
                run = CeleryTaskRun(task, options, args, kwargs, call, takes_key=takes_key)
                return run.execute()

        # Celery checks a task's arguments against this when it is sent, not in the worker.
        run.__signature__ = signature(body, first=None if bind else "task")  # type: ignore[attr-defined]
        return shared_task(bind=True, **task_options)(run)

    return declare_task if func is None else declare_task(func)


def _correlation_id(task: Task) -> str | None:
    """The correlation id the task was sent with (``CeleryTaskDispatcher`` sends one)."""
    # Eager runs keep the message's headers apart; a worker merges them into the request.
    request = task.request
    headers = getattr(request, "headers", None)
    return correlation.from_headers(headers) or correlation.clean(request.get(correlation.HEADER))


class CeleryTaskRun(TaskRun):
    """One delivery of an idempotent Celery task; a busy one is retried by Celery."""

    def __init__(
        self,
        task: Task,
        options: TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: Callable[..., Any],
        *,
        takes_key: bool = False,
    ) -> None:
        self.task = task
        super().__init__(task.name, options, args, kwargs, body, sender=task, takes_key=takes_key)

    def retry(self, countdown: float, busy: TaskInProgress) -> Any:
        raise self.task.retry(countdown=countdown, exc=busy)
