"""Idempotent Celery tasks: a task delivered twice has its effect once.

Celery delivers at least once: a worker that dies under ``acks_late``, a producer that sends
twice after a timeout, a broker's visibility timeout, beat firing on two schedulers. Decorate
the task with ``idempotent_task`` and each delivery claims the task's key in the key table
first, as an idempotent view does:

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

from django import db
from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder
from django.db import router, transaction
from django.utils import timezone

from django_idempotency import _optional, canonical, correlation, signals
from django_idempotency.conf import TASK_METHOD, checked, idempotency_settings
from django_idempotency.engine import ROUTE_LENGTH, fit_scope
from django_idempotency.keys import MAX_LENGTH, ScopedKey
from django_idempotency.leases import leases
from django_idempotency.models import IdempotencyKey
from django_idempotency.outcomes import Outcome
from django_idempotency.store import Claim, Conflict, KeyBusy, KeyStore, NewKey, StoredResponse

with _optional.requires("celery", __name__):
    from celery import shared_task

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime, timedelta

    from celery import Task

    from django_idempotency.conf import Mode

logger = logging.getLogger("django_idempotency")

#: The keyword argument a caller passes to give a task's run its key.
KEY_ARGUMENT = "idempotency_key"
OnBusy = Literal["retry", "skip"]

# Lease mode: how often a delivery looks again while another holds the key's lease.
POLL_SECONDS = 0.05
_RESULT_HEADERS = [("Content-Type", "application/json")]


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
                return TaskRun(task, options, args, kwargs).execute(call, takes_key=takes_key)

        # Celery checks a task's arguments against this when it is sent, not in the worker.
        run.__signature__ = _signature(body, bind=bind)  # type: ignore[attr-defined]
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


class TaskRun:
    """One delivery of an idempotent task: claim its key, run the body, store its result."""

    def __init__(
        self, task: Task, options: TaskOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
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
        self.scope = fit_scope(scope)
        # What the body and the recover hook get: the key, with its downstream_key.
        self.key = ScopedKey(key, self.scope)
        self.fingerprint = arguments_fingerprint(args, kwargs)
        self.mode: Mode = options.mode
        self.ttl: timedelta = options.setting("TTL")
        self.wait_timeout: float = options.setting("WAIT_TIMEOUT")
        self.lease_timeout: timedelta = options.setting("LEASE_TIMEOUT")
        self.started = time.perf_counter()

    def new_key(self, now: datetime) -> NewKey:
        return NewKey(
            scope=self.scope,
            key=self.key,
            method=TASK_METHOD,
            route=self.name[:ROUTE_LENGTH],
            fingerprint=self.fingerprint,
            now=now,
            expires_at=now + self.ttl,
            wait_timeout=self.wait_timeout,
            locked_until=now + self.lease_timeout if self.mode == "lease" else None,
        )

    def execute(self, body: Callable[..., Any], *, takes_key: bool = False) -> Any:
        """Run ``body`` once for the key; or return the result stored by the run that did.

        ``takes_key``: the body is called with the key as its ``idempotency_key`` argument.
        """
        if takes_key:
            body = functools.partial(body, **{KEY_ARGUMENT: self.key})
        if not idempotency_settings.ENABLED:
            return body(**self.kwargs)
        store = KeyStore(router.db_for_write(IdempotencyKey))
        try:
            if self.mode == "lease":
                return self._lease(store, body)
            return self._atomic(store, body)
        except KeyBusy:
            return self._busy()

    def _atomic(self, store: KeyStore, body: Callable[..., Any]) -> Any:
        with transaction.atomic(using=store.using):
            found = store.acquire(self.new_key(timezone.now()))
            if not isinstance(found, Claim):
                return self._settled(found)
            try:
                result = body(**self.kwargs)
                stored = _encode(result)
            except BaseException as exc:  # Celery's Retry too: the key goes with the writes
                self._report(Outcome.NOT_STORED, claim=found, error=exc)
                raise
            if not store.complete(found, now=timezone.now(), **stored):  # pragma: no cover
                raise KeyBusy  # the row is locked by this transaction; never commit without it
        self._report(Outcome.STORED, claim=found)
        return result

    def _lease(self, store: KeyStore, body: Callable[..., Any]) -> Any:
        if transaction.get_connection(store.using).in_atomic_block:
            msg = (
                "A lease-mode task commits its key before its body runs, so it must not run "
                "inside a transaction."
            )
            raise ImproperlyConfigured(msg)
        deadline = time.monotonic() + self.wait_timeout
        while True:
            with transaction.atomic(using=store.using):
                found = store.acquire(self.new_key(timezone.now()))
            if isinstance(found, Claim):
                break
            if isinstance(found, StoredResponse) or not found.fingerprint_matches:
                return self._settled(found)
            # A lease that runs out meanwhile is taken over by the claim itself.
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise KeyBusy
            time.sleep(min(POLL_SECONDS, remaining))
        claim = found
        with leases.keep(store, claim, self.key, self.lease_timeout):
            try:
                with transaction.atomic(using=store.using):
                    result = self._recovered(claim, body)
                    kept = store.complete(claim, now=timezone.now(), **_encode(result))
                    if not kept:
                        transaction.set_rollback(True, using=store.using)
            except BaseException as exc:
                self._report(Outcome.NOT_STORED, claim=claim, error=exc)
                _release(store, claim)
                raise
        if not kept:
            logger.error(
                "the lease on the key %s of task %s was taken over while it ran: its writes "
                "were rolled back",
                self.key,
                self.name,
            )
            raise KeyBusy
        self._report(Outcome.STORED, claim=claim)
        return result

    def _recovered(self, claim: Claim, body: Callable[..., Any]) -> Any:
        recover = self.options.recover
        if claim.attempts > 1 and recover is not None:
            # An earlier delivery with this key did not finish: its effect may have happened.
            result = recover(*self.args, key=self.key, attempt=claim.attempts, **self.kwargs)
            if result is not None:
                return result
        return body(**self.kwargs)

    def _settled(self, found: StoredResponse | Conflict) -> Any:
        if isinstance(found, StoredResponse):
            self._report(Outcome.REPLAYED, attempt=found.replay_count + 1)
            return json.loads(found.body)
        if found.fingerprint_matches:
            raise KeyBusy  # atomic mode: the store already waited as long as it may
        self._report(Outcome.MISMATCH)
        msg = f"The key {self.key!r} of task {self.name} was used with other arguments."
        raise TaskPayloadMismatch(msg)

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
        self,
        outcome: Outcome,
        *,
        claim: Claim | None = None,
        attempt: int = 1,
        error: BaseException | None = None,
    ) -> None:
        if claim is not None:
            attempt = claim.attempts
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


def _encode(result: Any) -> dict[str, Any]:
    """The stored form of a task's result: JSON, as a stored response's body."""
    body = json.dumps(result, cls=DjangoJSONEncoder).encode()
    return {"status": 200, "headers": _RESULT_HEADERS, "body": body}


def _release(store: KeyStore, claim: Claim) -> None:
    """Mark a lease-mode key failed so the next delivery runs; never mask the body's error."""
    try:
        store.fail(claim)
    except db.Error:  # any database failure: psycopg2's lost connection is no DatabaseError
        logger.warning("could not release an idempotency key; its lease will run out")
