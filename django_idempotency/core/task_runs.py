"""An idempotent task, whichever framework runs it: its options, its key, and its run.

The adapters (``django_idempotency.celery`` for Celery, ``django_idempotency.django_tasks`` for
Django's Tasks framework) declare tasks with what is here; each run of a task is a ``TaskRun``,
an operation of the engine that runs idempotent views. An adapter says how its framework retries
a run that finds its key busy, and nothing else: the key, the fingerprint, the modes, the stored
result, the logs and the signal are the same for both.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency import signals
from django_idempotency.conf import TASK_METHOD, checked, idempotency_settings
from django_idempotency.core import canonical
from django_idempotency.core.engine import default_engine
from django_idempotency.core.operation import Operation, Record, fit_scope
from django_idempotency.core.outcomes import Outcome
from django_idempotency.exceptions import (
    TaskInProgress,
    TaskKeyInvalid,
    TaskKeyMissing,
    TaskPayloadMismatch,
)
from django_idempotency.keys import MAX_LENGTH, ScopedKey

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import timedelta

    from django_idempotency.conf import Mode
    from django_idempotency.core.rows import StoredResponse

logger = logging.getLogger("django_idempotency")

#: The keyword argument a caller passes to give a task's run its key.
KEY_ARGUMENT = "idempotency_key"
OnBusy = Literal["retry", "skip"]

_RESULT_HEADERS = [("Content-Type", "application/json")]

#: The idempotent tasks declared so far, by name, with either adapter: each one's mode, and
#: whether its body takes its key. The system checks read it (Celery's own registry fills only
#: when its app is finalized).
DECLARED_TASKS: dict[str, tuple[Mode, bool]] = {}


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


def declare(name: str, options: TaskOptions, body: Callable[..., Any]) -> bool:
    """Record the task ``name`` for the system checks; return whether its body takes its key."""
    takes_key = KEY_ARGUMENT in inspect.signature(body).parameters
    DECLARED_TASKS[name] = (options.mode, takes_key)
    return takes_key


def signature(body: Callable[..., Any], *, first: str | None) -> inspect.Signature:
    """The body's signature with the caller's key argument added, and ``first`` (the task, or
    its context) put before its parameters if the framework passes it and the body does not
    take it."""
    body_signature = inspect.signature(body)
    parameters = list(body_signature.parameters.values())
    if first is not None:
        parameters.insert(0, inspect.Parameter(first, inspect.Parameter.POSITIONAL_ONLY))
    if KEY_ARGUMENT in body_signature.parameters:
        # The body takes the key itself (to pass it on to a provider, say): callers may omit it.
        parameters = [
            parameter.replace(default=None) if parameter.name == KEY_ARGUMENT else parameter
            for parameter in parameters
        ]
    else:
        key = inspect.Parameter(KEY_ARGUMENT, inspect.Parameter.KEYWORD_ONLY, default=None)
        variadic = parameters and parameters[-1].kind == inspect.Parameter.VAR_KEYWORD
        parameters.insert(len(parameters) - 1 if variadic else len(parameters), key)
    return body_signature.replace(parameters=parameters)


def as_key(value: Any) -> str:
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
    """One run of an idempotent task: the operation the engine runs once per key.

    Its result is stored as JSON, as a response's body; a duplicate gets it back decoded. An
    adapter subclasses it to say how its framework runs a busy run again (``retry``).
    """

    lease_in_transaction = (
        "A lease-mode task commits its key before its body runs, so it must not run "
        "inside a transaction."
    )

    def __init__(
        self,
        name: str,
        options: TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        body: Callable[..., Any],
        *,
        sender: object,
        takes_key: bool = False,
    ) -> None:
        self.sender = sender  # the signal's sender: the framework's task
        self.options = options
        self.args = args
        #: The key the caller gave, if any: a retry is sent with it.
        self.given_key = kwargs.pop(KEY_ARGUMENT, None)
        self.kwargs = kwargs
        self.name = name
        if self.given_key is not None:
            key = as_key(self.given_key)
        elif options.key is not None:
            key = as_key(options.key(*args, **kwargs))
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
        except BaseException as exc:  # a framework's retry too: nothing of the run is kept
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

    @abstractmethod
    def retry(self, countdown: float, busy: TaskInProgress) -> Any:
        """Have the framework run the task again in ``countdown`` seconds; raise, or return what
        this run returns."""

    def _busy(self) -> Any:
        """Another run holds the key: try again later, or leave the key to it."""
        self._report(Outcome.IN_PROGRESS)
        if self.options.on_busy == "skip":
            return None
        countdown = self.options.busy_countdown
        if countdown is None:
            countdown = max(1.0, self.wait_timeout)
        msg = f"Another run of task {self.name} holds the key {self.key!r}."
        return self.retry(countdown, TaskInProgress(msg))

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
            self.sender,
            task=self.name,
            key=self.key,
            scope=self.scope,
            outcome=str(outcome),
            attempt=attempt,
            error=error,
        )
