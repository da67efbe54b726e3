"""One logical request over its attempts: whether to retry, how long to wait, when to stop.

The loop is tenacity's; this module supplies its retry, wait and stop decisions, for any HTTP
library that describes its responses, errors and timeouts with a few callables.
``django_idempotency.client._start`` prepares the request and makes the operation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, cast

# Imported by the package's __init__, which names the extra to install if tenacity is missing.
import tenacity
from tenacity.retry import retry_base
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from django_idempotency import guard
from django_idempotency.client._breaker import CircuitOpen
from django_idempotency.client._policy import (
    CONFLICT,
    FAILING_STATUSES,
    RETRYABLE_STATUSES,
    backoff,
    parse_retry_after,
)
from django_idempotency.core.outcomes import report_retry

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, MutableMapping

    from django_idempotency.client._breaker import Admission, CallResult, CircuitBreaker
    from django_idempotency.client._budgets import RetryBudget
    from django_idempotency.client._policy import RetryPolicy

# The documented logger is the package's, whichever of its modules logs.
logger = logging.getLogger("django_idempotency.client")

# A discarded response is read to its end so that its connection can be reused, unless its body
# is longer than this; then the connection is closed instead.
_DRAIN_LIMIT: Final = 64 * 1024

# An attempt made with no time left still gets this long (seconds): it fails at once, with the
# HTTP client's own timeout error.
_MIN_TIMEOUT: Final = 0.001

R = TypeVar("R")


@dataclass(frozen=True)
class _Decision:
    attempt: int
    delay: float
    stop: str | None


class Operation(Generic[R]):
    """Decide for one logical request, over its attempts, what to retry and how long to wait.

    Made by ``start_operation()``; making one changes neither the request, the budget nor the
    circuit: the first attempt counts in the budget, once the circuit has let it through.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        method: str,
        host: str,
        headers: MutableMapping[str, str],
        retryable: bool,
        budget: RetryBudget | None,
        breaker: CircuitBreaker | None,
        deadline: float,
        status: Callable[[R], int],
        retry_after: Callable[[R], str | None],
        transient: Callable[[BaseException], bool],
        set_timeout: Callable[[float], None],
        circuit_open: Callable[[str, float], BaseException],
    ) -> None:
        self.policy = policy
        self.method = method
        self.host = host
        self.headers = headers
        self.retryable = retryable
        self.budget = budget
        self.breaker = breaker
        self.deadline = deadline
        self._status = status
        self._retry_after = retry_after
        self._transient = transient
        self._set_timeout = set_timeout
        self._circuit_open = circuit_open
        self._attempts = 0
        self.reason = ""
        self.discarded: R | None = None
        self._previous_delay = policy.base_delay
        self._decision: _Decision | None = None

    def failure(self, state: tenacity.RetryCallState) -> str | None:
        """Return why the last attempt failed, if another attempt may succeed; else None."""
        if not self.retryable:
            return None
        outcome = _outcome(state)
        error = outcome.exception()
        if error is not None:
            # A circuit that opened while this request waited to retry: retrying it is what the
            # circuit is there to stop.
            transient = self._transient(error) and not isinstance(error, CircuitOpen)
            return type(error).__name__ if transient else None
        response = outcome.result()
        status = self._status(response)
        if status in RETRYABLE_STATUSES:
            return f"status {status}"
        # A server running this library answers a duplicate of a request still running with
        # 409 and Retry-After: sent again later with the same key, it gets the first's answer.
        keyed = self.policy.key_header in self.headers
        if status == CONFLICT and keyed and self._retry_after(response) is not None:
            return "status 409, in progress"
        return None

    def decide(self, state: tenacity.RetryCallState) -> _Decision:
        """Return the wait before the next attempt and whether to stop instead, once per attempt."""
        # Tenacity asks for the wait and the stop separately, in an order that changed between
        # versions; deciding both together spends the budget once, and only on a real retry.
        attempt = state.attempt_number
        if self._decision is None or self._decision.attempt != attempt:
            delay = self._delay(attempt, _response(state))
            self._decision = _Decision(attempt, delay, self._stop(attempt, delay))
        return self._decision

    def _delay(self, attempt: int, response: R | None) -> float:
        delay = self._previous_delay = backoff(self.policy, attempt, self._previous_delay)
        value = None if response is None else self._retry_after(response)
        if value is not None:
            retry_after = parse_retry_after(value, self.policy.wall_clock())
            if retry_after is not None:
                delay = max(delay, retry_after)
        return delay

    def _stop(self, attempt: int, delay: float) -> str | None:
        policy = self.policy
        if attempt >= policy.max_attempts:
            return "attempts"
        if delay > policy.max_delay:
            # Only Retry-After can ask for more than max_delay. Coming back sooner than the server
            # asked would be refused again, so the response is returned now.
            return "retry_after"
        if policy.clock() + delay >= self.deadline:
            # The next attempt would have no time left to run.
            return "deadline"
        if self.breaker is not None and self.breaker.state != "closed":
            # This request's failures, or other requests', opened the host's circuit.
            return "circuit_open"
        # Last, so that a token is spent only on a retry that will happen.
        if self.budget is not None and not self.budget.try_withdraw():
            return "budget"
        return None

    def before_sleep(self, state: tenacity.RetryCallState) -> None:
        """Log the retry and set the failed attempt's response aside to be released."""
        decision = self.decide(state)
        logger.info(
            "retrying %s %s in %.3f s after attempt %d: %s",
            self.method,
            self.host,
            decision.delay,
            decision.attempt,
            self.reason,
            extra=self._fields(decision),
        )
        report_retry("client", decision.delay, decision.attempt, host=self.host, reason=self.reason)
        self.discarded = _response(state)

    def give_up(self, state: tenacity.RetryCallState) -> R:
        """Log why there is no retry, then return the last response or raise the last error."""
        decision = self.decide(state)
        logger.info(
            "not retrying %s %s after attempt %d (%s): %s",
            self.method,
            self.host,
            decision.attempt,
            self.reason,
            decision.stop,
            extra={**self._fields(decision), "idempotency_client_stop": decision.stop},
        )
        return cast("R", _outcome(state).result())

    def _fields(self, decision: _Decision) -> dict[str, Any]:
        # No header values or bodies: they may carry credentials or personal data.
        return {
            "idempotency_client_host": self.host,
            "idempotency_client_attempt": decision.attempt,
            "idempotency_client_delay": decision.delay,
            "idempotency_client_reason": self.reason,
        }

    def _pieces(self) -> dict[str, Any]:
        return {
            "retry": _RetryIfTransient(self),
            "wait": _WaitBackoff(self),
            "stop": _StopWhenSpent(self),
            "before_sleep": self.before_sleep,
            "retry_error_callback": self.give_up,
        }

    def before_attempt(self) -> Admission | None:
        """Pass the circuit, bound the attempt by what is left of the deadline, tell the server.

        Raises the transport's ``CircuitOpen`` error if the host's circuit refuses the attempt.
        """
        admission = None
        if self.breaker is not None:
            admission = self.breaker.admit()
            if not admission.allowed:
                raise self._circuit_open(self.host, admission.retry_in)
        self._attempts += 1
        if self._attempts == 1 and self.budget is not None:
            # Counted once the request is sent: a request failed fast must not earn retries.
            self.budget.deposit()
        left = max(0.0, self.deadline - self.policy.clock())
        # An attempt cannot outlast the deadline: timeouts shrink inward, call after call.
        self._set_timeout(max(left, _MIN_TIMEOUT))
        if self.policy.propagate:
            self.headers[guard.TIMEOUT_HEADER] = str(int(left * 1000))
        return admission

    def after_attempt(
        self, admission: Admission | None, response: R | None, error: BaseException | None
    ) -> None:
        """Count the attempt's outcome in the host's circuit."""
        if self.breaker is None or admission is None:
            return
        outcome: CallResult
        if error is not None:
            # An error that is not transient (a TLS failure, a cancelled task) says nothing of
            # the host's health.
            outcome = "failure" if self._transient(error) else "neither"
        else:
            failing = self._status(cast("R", response)) in FAILING_STATUSES
            outcome = "failure" if failing else "success"
        self.breaker.record(admission, outcome)

    def run(self, send: Callable[[], R], discard: Callable[[R], None]) -> R:
        """Send the request until it succeeds or a retry is not allowed."""

        def sleep(seconds: float) -> None:
            if self.discarded is not None:
                discard(self.discarded)
                self.discarded = None
            self.policy.sleep(seconds)

        def attempt() -> R:
            admission = self.before_attempt()
            try:
                response = send()
            except BaseException as error:
                self.after_attempt(admission, None, error)
                raise
            self.after_attempt(admission, response, None)
            return response

        return tenacity.Retrying(sleep=sleep, **self._pieces())(attempt)

    async def arun(
        self, send: Callable[[], Awaitable[R]], discard: Callable[[R], Awaitable[None]]
    ) -> R:
        """Send the request until it succeeds or a retry is not allowed, without blocking."""

        # The response is released here rather than in before_sleep, which older tenacity
        # versions call without awaiting.
        async def sleep(seconds: float) -> None:
            if self.discarded is not None:
                await discard(self.discarded)
                self.discarded = None
            await self.policy.async_sleep(seconds)

        async def attempt() -> R:
            admission = self.before_attempt()
            try:
                response = await send()
            except BaseException as error:
                self.after_attempt(admission, None, error)
                raise
            self.after_attempt(admission, response, None)
            return response

        return cast("R", await tenacity.AsyncRetrying(sleep=sleep, **self._pieces())(attempt))


class _RetryIfTransient(retry_base):
    def __init__(self, operation: Operation[Any]) -> None:
        self.operation = operation

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        self.operation.reason = self.operation.failure(retry_state) or ""
        return bool(self.operation.reason)


class _WaitBackoff(wait_base):
    def __init__(self, operation: Operation[Any]) -> None:
        self.operation = operation

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.operation.decide(retry_state).delay


class _StopWhenSpent(stop_base):
    def __init__(self, operation: Operation[Any]) -> None:
        self.operation = operation

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self.operation.decide(retry_state).stop is not None


def _outcome(state: tenacity.RetryCallState) -> tenacity.Future:
    # Tenacity calls the retry, wait and stop pieces only once an attempt has an outcome.
    return cast("tenacity.Future", state.outcome)


def _response(state: tenacity.RetryCallState) -> Any:
    outcome = _outcome(state)
    return None if outcome.failed else outcome.result()


def drain(chunks: Iterable[bytes]) -> None:
    """Read a discarded response's body, up to a limit, so that its connection can be reused."""
    read = 0
    for chunk in chunks:
        read += len(chunk)
        if read > _DRAIN_LIMIT:
            return


async def adrain(chunks: AsyncIterable[bytes]) -> None:
    """Read a discarded response's body, up to a limit, so that its connection can be reused."""
    read = 0
    async for chunk in chunks:
        read += len(chunk)
        if read > _DRAIN_LIMIT:
            return
