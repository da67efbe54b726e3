"""The start of a logical request: its key, headers for the service below, budget and deadline."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, TypeVar

from django_idempotency import guard
from django_idempotency.client._operation import Operation
from django_idempotency.client._policy import IDEMPOTENT_METHODS, KEYED_METHODS
from django_idempotency.core import correlation

if TYPE_CHECKING:
    from collections.abc import Callable, MutableMapping

    from django_idempotency.client._policy import RetryPolicy

R = TypeVar("R")


def start_operation(
    policy: RetryPolicy,
    *,
    method: str,
    host: str,
    headers: MutableMapping[str, str],
    replayable: bool,
    status: Callable[[R], int],
    retry_after: Callable[[R], str | None],
    transient: Callable[[BaseException], bool],
    set_timeout: Callable[[float], None],
    circuit_open: Callable[[str, float], BaseException],
) -> Operation[R]:
    """Prepare a request for its first attempt and return the operation that will send it.

    Adds the idempotency key, ``Do-Not-Retry`` and the correlation id to ``headers``.
    ``circuit_open`` makes the
    error raised instead of an attempt while the circuit of ``host`` is open.
    """
    method = method.upper()
    keyed = _add_key(policy, method, headers)
    inbound = guard.current() if policy.propagate else guard.Inbound()
    # When the caller of the request being handled retries it, retrying here too would multiply
    # the attempts on the service below.
    retryable = inbound.retries_allowed and _may_retry(policy, method, keyed, replayable)
    if policy.propagate and (retryable or not inbound.retries_allowed):
        headers[guard.DO_NOT_RETRY_HEADER] = "1"
    # The service below logs with the id of the work that called it.
    correlation_id = correlation.get_correlation_id() if policy.propagate else None
    if correlation_id is not None and correlation.HEADER not in headers:
        headers[correlation.HEADER] = correlation_id
    budget = None if policy.budget is None else policy.budget.budget_for(host)
    breaker = None if policy.breaker is None else policy.breaker.breaker_for(host)
    started = policy.clock()
    caller_waits = inbound.remaining()
    deadline = started + (
        policy.deadline if caller_waits is None else min(policy.deadline, caller_waits)
    )
    return Operation(
        policy,
        method=method,
        host=host,
        headers=headers,
        retryable=retryable,
        budget=budget,
        breaker=breaker,
        deadline=deadline,
        status=status,
        retry_after=retry_after,
        transient=transient,
        set_timeout=set_timeout,
        circuit_open=circuit_open,
    )


def _add_key(policy: RetryPolicy, method: str, headers: MutableMapping[str, str]) -> bool:
    """Return whether the request carries an idempotency key, adding one if the policy says so."""
    if policy.key_header in headers:
        return True
    if policy.add_keys and method in KEYED_METHODS:
        # Added once, to the original request, so that every retry repeats the same key and
        # the server can recognise the retries as one operation.
        headers[policy.key_header] = str(uuid.uuid4())
        return True
    return False


def _may_retry(policy: RetryPolicy, method: str, keyed: bool, replayable: bool) -> bool:
    """Return whether the policy allows a retry and sending the request again is safe."""
    return (
        replayable
        and policy.max_attempts > 1
        and (method in IDEMPOTENT_METHODS or (method in KEYED_METHODS and keyed))
    )
