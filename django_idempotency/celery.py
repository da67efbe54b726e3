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
import hashlib
import inspect
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency import signals
from django_idempotency.conf import TASK_METHOD, checked, idempotency_settings
from django_idempotency.core import canonical, correlation, optional
from django_idempotency.core.engine import default_engine
from django_idempotency.core.operation import Operation, Record, fit_scope
from django_idempotency.core.outcomes import Outcome
from django_idempotency.keys import MAX_LENGTH, ScopedKey

__all__ = [
    "TaskInProgress",
    "TaskKeyInvalid",
    "TaskKeyMissing",
    "TaskPayloadMismatch",
    "idempotent_task",
]

with optional.requires("celery", __name__):
    from celery import shared_task

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta

    from celery import Task

    from django_idempotency.conf import Mode
    from django_idempotency.core.rows import StoredResponse

logger = logging.getLogger("django_idempotency")

#: The keyword argument a caller passes to give a task's run its key.
KEY_ARGUMENT = "idempotency_key"
OnBusy = Literal["retry", "skip"]

_RESULT_HEADERS = [("Content-Type", "application/json")]

#: The idempotent tasks declared so far, by name: each one's mode, and whether its body takes its
#: key. The system checks read it: Celery's own registry fills only when its app is finalized.
DECLARED_TASKS: dict[str, tuple[Mode, bool]] = {}


class TaskKeyMissing(ValueError):
    """The task has no ``key`` function and was sent without ``idempotency_key=``."""


class TaskKeyInvalid(ValueError):
    """The task's key is not a non-empty string (or integer)."""


class TaskPayloadMismatch(Exception):
    """The key was used before with other arguments: the body does not run."""


class TaskInProgress(Exception):
    """Another delivery holds the key and did not finish in time (and ``on_busy="skip"``
    was not asked for, or Celery ran out of retries)."""


@dataclass(frozen=True)
class TaskOptions:
    """A task's idempotency options; one left ``None`` follows its ``IDEMPOTENCY`` key."""

    key: Callable[..., Any] | None = None
    tenant: Callable[..., Any] | None = None
    mode: Mode = "atomic"
    ttl: timedelta | float | None = None
    wait_timeout: float | None = None
    lease_timeout: timedelta | float | None = None
    recover: Callable[..., Any] | None = None
    on_busy: OnBusy = "retry"
    busy_countdown: float | None = None

    def __post_init__(self) -> None:
        # Checked when the task is declared, as a view's options are.
        checked("MODE", self.mode, "The task's mode option")
        for name in ("ttl", "wait_timeout", "lease_timeout"):
            if (value := getattr(self, name)) is not None:
                checked(name.upper(), value, f"The task's {name} option")
        if self.on_busy not in ("retry", "skip"):
            msg = f'The task\'s on_busy option must be "retry" or "skip"; got {self.on_busy!r}.'
            raise ImproperlyConfigured(msg)
        if self.recover is not None and self.mode != "lease":
            msg = "The task's recover hook is for lease mode: only there can a run be cut short."
            raise ImproperlyConfigured(msg)

    def setting(self, name: str) -> Any:
        value = getattr(self, name.lower())
        if value is None:
            return idempotency_settings.get(name)
        return checked(name, value, f"The task's {name.lower()} option")


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

    def declare(body: Callable[..., Any]) -> Any:
        takes_key = _takes_key(body)

        @functools.wraps(body)
        def run(task: Task, *args: Any, **kwargs: Any) -> Any:
            call = functools.partial(body, task, *args) if bind else functools.partial(body, *args)
            with correlation.bind(_correlation_id(task)):
                return TaskRun(task, options, args, kwargs, call, takes_key=takes_key).execute()

        # Celery checks a task's arguments against this when it is sent, not in the worker.
        run.__signature__ = _signature(body, bind=bind)  # type: ignore[attr-defined]
        # Celery's own default name; the task object would say it only once its app is finalized.
        name = task_options.get("name") or f"{body.__module__}.{body.__name__}"
        DECLARED_TASKS[name] = (options.mode, takes_key)
        return shared_task(bind=True, **task_options)(run)

    return declare if func is None else declare(func)


def _correlation_id(task: Task) -> str | None:
    """The correlation id the task was sent with (``CeleryTaskDispatcher`` sends one)."""
    # Eager runs keep the message's headers apart; a worker merges them into the request.
    request = task.request
    headers = getattr(request, "headers", None)
    return correlation.from_headers(headers) or correlation.clean(request.get(correlation.HEADER))


def _signature(body: Callable[..., Any], *, bind: bool) -> inspect.Signature:
    """The body's signature, bound to its task, with the caller's key argument added."""
    signature = inspect.signature(body)
    parameters = list(signature.parameters.values())
    if not bind:
        parameters.insert(0, inspect.Parameter("task", inspect.Parameter.POSITIONAL_ONLY))
    if KEY_ARGUMENT in signature.parameters:
        # The body takes the key itself (to pass it on to a provider, say): callers may omit it.
        parameters = [
            parameter.replace(default=None) if parameter.name == KEY_ARGUMENT else parameter
            for parameter in parameters
        ]
    else:
        key = inspect.Parameter(KEY_ARGUMENT, inspect.Parameter.KEYWORD_ONLY, default=None)
        variadic = parameters and parameters[-1].kind == inspect.Parameter.VAR_KEYWORD
        parameters.insert(len(parameters) - 1 if variadic else len(parameters), key)
    return signature.replace(parameters=parameters)


def _takes_key(body: Callable[..., Any]) -> bool:
    return KEY_ARGUMENT in inspect.signature(body).parameters


def _as_key(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        msg = f"A task's idempotency key is a non-empty string or an integer; got {value!r}."
        raise TaskKeyInvalid(msg)
    key = str(value)
    if len(key) > MAX_LENGTH:
        # Longer keys (made of many arguments, say) are kept unique by their digest.
        key = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    return key


def arguments_fingerprint(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """SHA-256 of the task's arguments as canonical JSON: key order does not count."""
    return canonical.sha256({"args": list(args), "kwargs": kwargs})


class TaskRun(Operation[Any]):
    """One delivery of an idempotent task: the operation the engine runs once per key.

    Its result is stored as JSON, as a response's body; a duplicate gets it back decoded.
    """

    lease_in_transaction = (
        "A lease-mode task commits its key before its body runs, so it must not run "
        "inside a transaction."
    )

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
        self.options = options
        self.args = args
        explicit = kwargs.pop(KEY_ARGUMENT, None)
        self.kwargs = kwargs
        self.name: str = task.name
        if explicit is not None:
            key = _as_key(explicit)
        elif options.key is not None:
            key = _as_key(options.key(*args, **kwargs))
        else:
            msg = (
                f"The task {self.name} has no key function: send it with "
                f"{KEY_ARGUMENT}=..., or give idempotent_task a key=."
            )
            raise TaskKeyMissing(msg)
        scope = f"task:{self.name}"
        if options.tenant is not None:
            scope = f"{scope}|tenant:{options.tenant(*args, **kwargs)}"
        # What the body and the recover hook get: the key, with its downstream_key.
        self.key = ScopedKey(key, fit_scope(scope))
        # ``takes_key``: the body is called with the key as its ``idempotency_key`` argument.
        self.body = functools.partial(body, **{KEY_ARGUMENT: self.key}) if takes_key else body
        self.method = TASK_METHOD
        self.route = self.name
        self.fingerprint = arguments_fingerprint(args, kwargs)
        self.mode = options.mode
        self.ttl = options.setting("TTL")
        self.wait_timeout = options.setting("WAIT_TIMEOUT")
        self.lease_timeout = options.setting("LEASE_TIMEOUT")
        self.attempt: int | None = None  # once the key is claimed
        self.started = time.perf_counter()

    def execute(self) -> Any:
        """Run the body once for the key; or return the result stored by the run that did."""
        if not idempotency_settings.ENABLED:
            return self.body(**self.kwargs)
        try:
            answer = default_engine.run(self)
        except BaseException as exc:  # Celery's Retry too: nothing of the run is kept
            if self.attempt is not None:
                self._report(Outcome.NOT_STORED, attempt=self.attempt, error=exc)
            raise
        if answer.outcome == Outcome.IN_PROGRESS:
            return self._busy()
        self._report(answer.outcome, attempt=answer.attempt)
        if answer.outcome == Outcome.MISMATCH:
            msg = f"The key {self.key!r} of task {self.name} was used with other arguments."
            raise TaskPayloadMismatch(msg)
        return answer.result

    def run(self, attempt: int) -> Any:
        self.attempt = attempt
        return self.body(**self.kwargs)

    def recover(self, attempt: int) -> Any:
        self.attempt = attempt
        if self.options.recover is None:
            return None
        return self.options.recover(*self.args, key=self.key, attempt=attempt, **self.kwargs)

    def keeps(self, result: Any) -> bool:
        return True  # a body that fails raises

    def encode(self, result: Any) -> Record:
        body = json.dumps(result, cls=DjangoJSONEncoder).encode()
        return Record(200, _RESULT_HEADERS, body)

    def decode(self, stored: StoredResponse) -> Any:
        return json.loads(stored.body)

    def _busy(self) -> Any:
        """Another delivery holds the key: try again later, or leave the key to it."""
        self._report(Outcome.IN_PROGRESS)
        if self.options.on_busy == "skip":
            return None
        countdown = self.options.busy_countdown
        if countdown is None:
            countdown = max(1.0, self.wait_timeout)
        msg = f"Another run of task {self.name} holds the key {self.key!r}."
        raise self.task.retry(countdown=countdown, exc=TaskInProgress(msg))

    def _report(
        self, outcome: Outcome, *, attempt: int = 1, error: BaseException | None = None
    ) -> None:
        duration = time.perf_counter() - self.started
        logger.info(
            "idempotent task %s: key=%s task=%s",
            outcome,
            self.key,
            self.name,
            extra={
                "idempotency_outcome": str(outcome),
                "idempotency_key": self.key,
                "idempotency_task": self.name,
                "idempotency_attempt": attempt,
                "idempotency_duration_ms": round(duration * 1000, 3),
            },
        )
        signals.send_robustly(
            signals.task_decided,
            self.task,
            task=self.name,
            key=self.key,
            scope=self.scope,
            outcome=str(outcome),
            attempt=attempt,
            error=error,
        )
