"""Celery for the modules that load without it: declaring the package's tasks, sending by name.

Celery is optional, so it is imported here only when a task is declared or sent
(``django_idempotency.celery``, which a project imports for idempotent tasks, needs the extra
and imports Celery itself). The inbox and the outbox send their tasks by name: the tasks module
imports them, so they never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_idempotency.core import optional

if TYPE_CHECKING:
    from collections.abc import Callable

# Who needs Celery when the package's own tasks are declared or sent without it installed.
TASKS_MODULE = "django_idempotency.tasks"


def _app(needed_by: str) -> Any:
    with optional.requires("celery", needed_by):
        from celery import current_app  # noqa: PLC0415 - Celery is optional

    return current_app


def task(name: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """Declare one of the package's tasks, in whichever Celery app the project runs."""
    with optional.requires("celery", TASKS_MODULE):
        from celery import shared_task  # noqa: PLC0415 - Celery is optional

    # The tasks report through the database and the logs: a result backend would only fill up.
    return shared_task(name=name, ignore_result=True, **options)  # type: ignore[no-any-return] # Celery ships no types


def send_task(name: str, *, needed_by: str, **options: Any) -> None:
    """Send the task ``name`` through the broker; the broker's errors are the caller's."""
    _app(needed_by).send_task(name, **options)


def enqueue(name: str, *args: Any) -> Exception | None:
    """Send the package's task ``name`` with ``args``; return the broker's error, if any.

    The callers log the error and go on: what the task would do stays due in the database,
    and the periodic run does it.
    """
    app = _app(TASKS_MODULE)
    try:
        if app.conf.task_always_eager:
            # send_task() ignores task_always_eager, which a task's own delay() honours (tests
            # and brokerless setups run tasks in process): load the app's task modules, as a
            # worker does when it starts, and run the task here.
            app.loader.import_default_modules()
            app.tasks[name].delay(*args)
        else:
            app.send_task(name, args)
    except Exception as exc:  # the broker's errors have no common base class
        return exc
    return None
