"""A view's request as the engine's operation, and what every HTTP adapter shares.

The DRF mixin, the view decorator and Ninja each read the request their framework's way, then
hand it to ``handle()``: the key is read and checked, the scope and fingerprint taken, the
request becomes a ``KeyedRequest`` that the engine runs, and the decision is reported and
answered. An asynchronous view crosses to the engine's thread and back in one place
(``around_async``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import async_to_sync, sync_to_async

from django_idempotency import problems
from django_idempotency.conf import idempotency_settings
from django_idempotency.core.cache import ReplayCache
from django_idempotency.core.fingerprint import LengthRequired, UnreadableBody, request_fingerprint
from django_idempotency.core.operation import Answer, Operation, Record, fit_scope
from django_idempotency.core.outcomes import Decision, Outcome, report
from django_idempotency.core.responses import STATUS_HEADER, capture, replay_response
from django_idempotency.core.unavailable import DATABASE_UNAVAILABLE, unavailable_response
from django_idempotency.keys import REQUEST_ATTRIBUTE, InvalidKey, ScopedKey, parse_key
from django_idempotency.scope import AnonymousRejected

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency.core.engine import Engine
    from django_idempotency.core.rows import StoredResponse
    from django_idempotency.policy import Policy

T = TypeVar("T")

_HANDLED = "_django_idempotency_handled"


@dataclass
class KeyedRequest(Operation["HttpResponseBase"]):
    """A request with a valid key, once its scope and fingerprint are known."""

    lease_in_transaction = (
        "Lease mode commits the key before the view runs, so the view must not run "
        "inside a transaction: exempt it from ATOMIC_REQUESTS with "
        "django.db.transaction.non_atomic_requests."
    )

    request: HttpRequest
    view: Callable[[], HttpResponseBase]
    policy: Policy
    view_request: Any
    key: ScopedKey
    route: str
    fingerprint: str

    def __post_init__(self) -> None:
        policy = self.policy
        self.method = self.request.method or ""
        self.mode = policy.mode
        self.ttl = policy.ttl
        self.wait_timeout = policy.wait_timeout
        self.lease_timeout = policy.lease_timeout
        self.cache = ReplayCache(policy.cache) if policy.cache else None

    def run(self, attempt: int) -> HttpResponseBase:
        return self.view()

    def recover(self, attempt: int) -> HttpResponseBase | None:
        if self.policy.recover is None:
            return None
        return self.policy.recover(self.view_request, key=self.key, attempt=attempt)

    def keeps(self, result: HttpResponseBase) -> bool:
        return self.policy.stores(result.status_code)

    def encode(self, result: HttpResponseBase) -> Record:
        headers, body = capture(result)
        return Record(result.status_code, headers, body)

    def decode(self, stored: StoredResponse) -> HttpResponseBase:
        return replay_response(stored)

    def decision(
        self,
        outcome: Outcome,
        response: HttpResponseBase | None,
        *,
        attempt: int = 1,
        error: Exception | None = None,
    ) -> Decision:
        return Decision(
            outcome, response, self.key, self.scope, self.route, attempt, error, self.fingerprint
        )

    def answered(self, answer: Answer[HttpResponseBase]) -> Decision:
        """The engine's answer as the response to this request."""
        response = answer.result
        if answer.outcome == Outcome.MISMATCH:
            detail = "This key was already used with a different request."
            response = problems.problem_response(problems.PAYLOAD_MISMATCH, detail)
        elif answer.outcome == Outcome.IN_PROGRESS:
            detail = "A request with this key is still being processed; retry later."
            response = problems.problem_response(problems.IN_PROGRESS, detail)
        elif answer.outcome == Outcome.STORED:
            assert response is not None  # noqa: S101 - for the type checker
            response[STATUS_HEADER] = "stored"
        return self.decision(answer.outcome, response, attempt=answer.attempt)


def _read_key(request: HttpRequest, policy: Policy, route: str) -> str | Decision | None:
    """The request's key; or the answer to a missing or malformed one; or None if optional."""
    raw_key = request.headers.get(policy.header)
    if raw_key is None:
        if not policy.required:
            return None
        detail = f"Send an {policy.header} header to make this request safe to retry."
        response = problems.problem_response(problems.KEY_MISSING, detail)
        return Decision(Outcome.MISSING, response, route=route)
    try:
        return parse_key(raw_key)
    except InvalidKey as exc:
        detail = f"The {policy.header} header is invalid: {exc}."
        response = problems.problem_response(problems.KEY_INVALID, detail)
        return Decision(Outcome.INVALID, response, route=route)


def route_of(request: HttpRequest) -> str:
    """The URL pattern that matched ``request``, or its path if it was not resolved."""
    match = request.resolver_match
    return match.route if match is not None and match.route else request.path_info


def identify(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    policy: Policy,
    view_request: Any,
    *,
    route: str,
    key: str,
) -> KeyedRequest | Decision:
    """Take the scope and fingerprint of a request with ``key``, or the answer that refuses it."""
    try:
        scope = fit_scope(policy.scope_function(view_request, route))
    except AnonymousRejected:
        detail = f"Authenticate to send an {policy.header} header to this endpoint."
        response = problems.problem_response(problems.ANONYMOUS_REJECTED, detail)
        return Decision(Outcome.INVALID, response, key, route=route)
    try:
        fingerprint = request_fingerprint(request, route, policy.fingerprint_headers)
    except UnreadableBody as exc:
        # Refused before anything is claimed: the key stays free for a readable retry.
        unread = isinstance(exc, LengthRequired)
        problem = problems.LENGTH_REQUIRED if unread else problems.BODY_INVALID
        response = problems.problem_response(problem, str(exc))
        return Decision(Outcome.INVALID, response, key, route=route)
    scoped = ScopedKey(key, scope)
    setattr(request, REQUEST_ATTRIBUTE, scoped)  # for keys.key_of(request), in the view
    return KeyedRequest(request, view, policy, view_request, scoped, route, fingerprint)


def handle(
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    *,
    engine: Engine,
    policy: Policy,
    sender: Any,
    view_request: Any = None,
) -> HttpResponseBase:
    """Answer ``request``, calling ``view()`` at most once and only for a fresh key.

    With the ``ENABLED`` setting off, call ``view()`` as if there were no key handling.

    ``view_request`` is the request object the view sees (a DRF ``Request``): it is what the
    scope function and signal receivers get.
    """
    if request.method not in policy.methods or not idempotency_settings.ENABLED:
        return view()
    # Applied twice to one view (decorator and mixin, say), the outer one does the work.
    if getattr(request, _HANDLED, False):
        return view()
    setattr(request, _HANDLED, True)
    started = time.perf_counter()
    timed_view = TimedView(view)
    decision = _decide(engine, request, timed_view, policy, view_request or request)
    if decision is None:
        return view()
    duration = time.perf_counter() - started
    report(decision, sender, view_request or request, duration, timed_view.seconds)
    if decision.error is not None:
        raise decision.error
    assert decision.response is not None  # noqa: S101 - for the type checker
    return decision.response


def _decide(
    engine: Engine,
    request: HttpRequest,
    view: Callable[[], HttpResponseBase],
    policy: Policy,
    view_request: Any,
) -> Decision | None:
    route = route_of(request)
    key = _read_key(request, policy, route)
    if not isinstance(key, str):
        return key  # a refusal; or None: no key, and the view does not require one
    keyed: KeyedRequest | Decision | None = None
    try:
        keyed = identify(request, view, policy, view_request, route=route, key=key)
        if not isinstance(keyed, KeyedRequest):
            return keyed  # a refusal
        return keyed.answered(engine.run(keyed))
    except DATABASE_UNAVAILABLE:
        # The answer is the key's decision, reported with it. Before the key was claimed
        # (resolving the principal may be the request's first query: a lazy request.user),
        # nothing ran; in atomic mode the transaction was rolled back with the key; in lease
        # mode the view's effect may have happened, and the key tells the retry so.
        if not isinstance(keyed, KeyedRequest):
            response = unavailable_response(rolled_back=True)
            return Decision(Outcome.UNAVAILABLE, response, key, route=route)
        response = unavailable_response(rolled_back=policy.mode == "atomic")
        return keyed.decision(Outcome.UNAVAILABLE, response)
    except Exception as exc:  # reported, then re-raised by handle()
        if not isinstance(keyed, KeyedRequest):
            raise
        return keyed.decision(Outcome.NOT_STORED, None, error=exc)


class TimedView:
    """The view, counting the seconds it runs: the engine's overhead is the rest."""

    def __init__(self, view: Callable[[], HttpResponseBase]) -> None:
        self.view = view
        self.seconds = 0.0

    def __call__(self) -> HttpResponseBase:
        started = time.perf_counter()
        try:
            return self.view()
        finally:
            self.seconds += time.perf_counter() - started


async def around_async(
    handle: Callable[[Callable[[], T]], HttpResponseBase], body: Callable[[], Awaitable[T]]
) -> HttpResponseBase:
    """Run the synchronous ``handle`` around the asynchronous ``body``, from an async view.

    The engine runs in the request's thread for synchronous work, the one where Django's async
    ORM runs this request's queries too. The body, run from there, awaits on the event loop, and
    its queries come back to that thread: they join the transaction that holds the key, as in
    a synchronous view.
    """
    handled: HttpResponseBase = await sync_to_async(handle, thread_sensitive=True)(
        async_to_sync(body)
    )
    return handled
