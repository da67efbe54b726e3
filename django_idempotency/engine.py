"""The engine: claim the key, run the view, store its response, or replay a stored one.

It knows Django's request and response but nothing of Django REST framework; the DRF mixin and
the view decorator are thin adapters over ``Engine.handle``.

Atomic mode: the key row is inserted inside the same ``transaction.atomic`` as the view's own
writes and completed before the commit, so a fresh request costs one commit and a crash rolls
back the key with the effect. A concurrent duplicate blocks on the unique index until the first
commits, then replays.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import router, transaction
from django.utils import timezone

from django_idempotency import problems
from django_idempotency.cache import ReplayCache
from django_idempotency.conf import idempotency_settings
from django_idempotency.fingerprint import LengthRequired, UnreadableBody, request_fingerprint
from django_idempotency.keys import REQUEST_ATTRIBUTE, InvalidKey, ScopedKey, parse_key
from django_idempotency.leases import LeaseKeeper
from django_idempotency.leases import leases as default_leases
from django_idempotency.models import IdempotencyKey
from django_idempotency.outcomes import Decision, Outcome, report
from django_idempotency.responses import (
    DATABASE_UNAVAILABLE,
    STATUS_HEADER,
    capture,
    replay_response,
    unavailable_response,
)
from django_idempotency.scope import AnonymousRejected
from django_idempotency.store import (
    Claim,
    Conflict,
    KeyBusy,
    KeyStore,
    NewKey,
    StoredResponse,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency.policy import Policy

logger = logging.getLogger("django_idempotency")

_HANDLED = "_django_idempotency_handled"

# Lease mode: how often a duplicate looks again while the first request holds the lease.
LEASE_POLL_SECONDS = 0.05


SCOPE_LENGTH = IdempotencyKey._meta.get_field("scope").max_length or 0
ROUTE_LENGTH = IdempotencyKey._meta.get_field("route").max_length or 0


def _fit_scope(scope: str) -> str:
    """Keep a long scope unique but within its column: replace it by its digest."""
    if len(scope) <= SCOPE_LENGTH:
        return scope
    return "sha256:" + hashlib.sha256(scope.encode()).hexdigest()


@dataclass
class KeyedRequest:
    """A request with a valid key, once its scope and fingerprint are known."""

    request: HttpRequest
    view: Callable[[], HttpResponseBase]
    policy: Policy
    view_request: Any
    key: ScopedKey
    scope: str
    route: str
    fingerprint: str

    def new_key(self, now: datetime) -> NewKey:
        """The key row this request claims at ``now``."""
        lease = self.policy.mode == "lease"
        return NewKey(
            scope=self.scope,
            key=self.key,
            method=self.request.method or "",
            route=self.route[:ROUTE_LENGTH],  # shown in the admin; the scope holds it whole
            fingerprint=self.fingerprint,
            now=now,
            expires_at=now + self.policy.ttl,
            wait_timeout=self.policy.wait_timeout,
            locked_until=now + self.policy.lease_timeout if lease else None,
        )

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

    def settled(self, found: StoredResponse | Conflict) -> Decision | None:
        """The answer when another request holds the key: its stored response replayed, or a
        mismatch if that request was a different one; ``None`` while it is still running."""
        if isinstance(found, StoredResponse):
            return self.decision(
                Outcome.REPLAYED, replay_response(found), attempt=found.replay_count + 1
            )
        if found.fingerprint_matches:
            return None
        detail = "This key was already used with a different request."
        mismatch = problems.problem_response(problems.PAYLOAD_MISMATCH, detail)
        return self.decision(Outcome.MISMATCH, mismatch)

    @cached_property
    def cache(self) -> ReplayCache | None:
        return ReplayCache(self.policy.cache) if self.policy.cache else None

    def remember(self, stored: StoredResponse, using: str) -> None:
        """Put a replayed response in the replay cache, if there is one, after commit.

        Filled by the first replay, not by the request that stored the response: most keys are
        never replayed, and a fresh request should not pay for a cache write.
        """
        if self.cache is not None:
            self.cache.put_after_commit(
                scope=self.scope,
                key=self.key,
                fingerprint=self.fingerprint,
                stored=stored,
                using=using,
            )


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


def _release(store: KeyStore, claim: Claim) -> bool:
    """Mark a lease-mode key failed so that a retry runs again; never mask the real error.

    ``False`` if another request took the key over meanwhile.
    """
    try:
        return store.fail(claim)
    except DATABASE_UNAVAILABLE:
        logger.warning("could not release an idempotency key; its lease will run out")
        return True


def _pause_until(deadline: float) -> None:
    """Wait a little before looking at a key again; ``KeyBusy`` once ``deadline`` passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise KeyBusy
    time.sleep(min(LEASE_POLL_SECONDS, remaining))


class Engine:
    """Claim → execute → store, or replay.

    ``clock``, ``leases`` and ``store`` are injectable for tests; without a store, each request
    uses the database that the project's routers choose for writing keys.
    """

    def __init__(
        self,
        clock: Callable[[], datetime] = timezone.now,
        leases: LeaseKeeper = default_leases,
        store: KeyStore | None = None,
    ) -> None:
        self.clock = clock
        self.leases = leases
        self.store = store

    def handle(
        self,
        request: HttpRequest,
        view: Callable[[], HttpResponseBase],
        *,
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
        timed_view = _TimedView(view)
        decision = self._decide(request, timed_view, policy, view_request or request)
        if decision is None:
            return view()
        duration = time.perf_counter() - started
        report(decision, sender, view_request or request, duration, timed_view.seconds)
        if decision.error is not None:
            raise decision.error
        assert decision.response is not None  # noqa: S101 - for the type checker
        return decision.response

    def _decide(
        self,
        request: HttpRequest,
        view: Callable[[], HttpResponseBase],
        policy: Policy,
        view_request: Any,
    ) -> Decision | None:
        keyed = self._identify(request, view, policy, view_request)
        if not isinstance(keyed, KeyedRequest):
            return keyed  # a refusal; or None: no key, and the view does not require one
        try:
            return self._run(keyed)
        except KeyBusy:
            detail = "A request with this key is still being processed; retry later."
            response = problems.problem_response(problems.IN_PROGRESS, detail)
            return keyed.decision(Outcome.IN_PROGRESS, response)
        except DATABASE_UNAVAILABLE:
            # In atomic mode the transaction was rolled back with the key; in lease mode the
            # view's effect may have happened, and the key tells the retry so.
            response = unavailable_response(rolled_back=policy.mode == "atomic")
            return keyed.decision(Outcome.UNAVAILABLE, response)
        except Exception as exc:  # reported, then re-raised by handle()
            return keyed.decision(Outcome.NOT_STORED, None, error=exc)

    def _identify(
        self,
        request: HttpRequest,
        view: Callable[[], HttpResponseBase],
        policy: Policy,
        view_request: Any,
    ) -> KeyedRequest | Decision | None:
        """Read the request's key, scope and fingerprint, or the answer that refuses it."""
        route = route_of(request)
        key = _read_key(request, policy, route)
        if not isinstance(key, str):
            return key
        try:
            scope = _fit_scope(policy.scope_function(view_request, route))
        except AnonymousRejected:
            detail = f"Authenticate to send an {policy.header} header to this endpoint."
            response = problems.problem_response(problems.ANONYMOUS_REJECTED, detail)
            return Decision(Outcome.INVALID, response, key, route=route)
        except DATABASE_UNAVAILABLE:
            # Resolving the principal may be the request's first query (a lazy request.user).
            response = unavailable_response(rolled_back=True)
            return Decision(Outcome.UNAVAILABLE, response, key, route=route)
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
        return KeyedRequest(request, view, policy, view_request, scoped, scope, route, fingerprint)

    def _run(self, keyed: KeyedRequest) -> Decision:
        if keyed.cache is not None:
            cached = keyed.cache.get(
                scope=keyed.scope, key=keyed.key, fingerprint=keyed.fingerprint, now=self.clock()
            )
            if cached is not None:
                return keyed.decision(Outcome.REPLAYED, replay_response(cached))
        store = self.store or KeyStore(router.db_for_write(IdempotencyKey))
        if keyed.policy.mode == "lease":
            return self._execute_lease(keyed, store)
        return self._execute(keyed, store)

    def _acquire(self, keyed: KeyedRequest, store: KeyStore) -> Claim | StoredResponse | Conflict:
        """Ask the store for the key once; a response it replays goes to the cache too."""
        found = store.acquire(keyed.new_key(self.clock()))
        if isinstance(found, StoredResponse):
            keyed.remember(found, store.using)  # read-through
        return found

    def _complete(
        self, keyed: KeyedRequest, store: KeyStore, claim: Claim, response: HttpResponseBase
    ) -> bool:
        """Store the view's response on its claimed row. ``False`` if another request took the
        key over meanwhile."""
        headers, body = capture(response)
        status = response.status_code
        return store.complete(claim, status=status, headers=headers, body=body, now=self.clock())

    def _execute(self, keyed: KeyedRequest, store: KeyStore) -> Decision:
        """Atomic mode: claim, run and complete in one transaction with the view's writes."""
        connection = transaction.get_connection(store.using)
        # Under ATOMIC_REQUESTS, DRF marks the transaction for rollback when a view raises an
        # API error. A savepoint then undoes just the view's writes, and its answer is still
        # stored with the key; without ATOMIC_REQUESTS it would cost round trips.
        savepoint = bool(connection.settings_dict.get("ATOMIC_REQUESTS"))
        with transaction.atomic(using=store.using):
            claim = self._acquire(keyed, store)
            if not isinstance(claim, Claim):
                # The store waited on the other request as long as the policy allows.
                if (settled := keyed.settled(claim)) is None:
                    raise KeyBusy
                return settled
            with transaction.atomic(using=store.using, savepoint=savepoint):
                response = keyed.view()
            rolled_back = transaction.get_rollback(store.using)
            if rolled_back or not keyed.policy.stores(response.status_code):
                # Keep nothing, so that a retry runs on a clean slate.
                transaction.set_rollback(True, using=store.using)
                return keyed.decision(Outcome.NOT_STORED, response)
            if not self._complete(keyed, store, claim, response):  # pragma: no cover
                raise KeyBusy  # the row is locked by this transaction; never commit without it
        response[STATUS_HEADER] = "stored"
        return keyed.decision(Outcome.STORED, response)

    def _execute_lease(self, keyed: KeyedRequest, store: KeyStore) -> Decision:
        """Lease mode: commit the claim first, run the view under the lease, then store.

        For views whose effect leaves the database (a card charge): a duplicate sees the
        committed claim and waits for the result, and a request that dies leaves a lease that
        runs out, after which the next request with the key takes it over. The view's own
        writes commit in one transaction with the completion, which the lease version fences:
        a request whose key was taken over keeps none of them.
        """
        if transaction.get_connection(store.using).in_atomic_block:
            msg = (
                "Lease mode commits the key before the view runs, so the view must not run "
                "inside a transaction: exempt it from ATOMIC_REQUESTS with "
                "django.db.transaction.non_atomic_requests."
            )
            raise ImproperlyConfigured(msg)
        claim = self._wait_for_claim(keyed, store)
        if not isinstance(claim, Claim):
            return claim
        with self.leases.keep(store, claim, keyed.key, keyed.policy.lease_timeout):
            try:
                response, kept = self._run_fenced(keyed, store, claim)
            except Exception:
                if _release(store, claim):
                    raise
                return self._superseded(keyed, store)
        if response is None or (not kept and not _release(store, claim)):
            return self._superseded(keyed, store)  # the key is no longer this request's
        if not kept:
            return keyed.decision(Outcome.NOT_STORED, response, attempt=claim.attempts)
        response[STATUS_HEADER] = "stored"
        return keyed.decision(Outcome.STORED, response, attempt=claim.attempts)

    def _wait_for_claim(self, keyed: KeyedRequest, store: KeyStore) -> Claim | Decision:
        """Claim the key; while a live request holds it, look again until the wait runs out."""
        deadline = time.monotonic() + keyed.policy.wait_timeout
        while True:
            with transaction.atomic(using=store.using):
                found = self._acquire(keyed, store)
            if isinstance(found, Claim):
                return found
            if (settled := keyed.settled(found)) is not None:
                return settled
            # A lease that runs out meanwhile is taken over by the claim itself.
            _pause_until(deadline)

    def _run_fenced(
        self, keyed: KeyedRequest, store: KeyStore, claim: Claim
    ) -> tuple[HttpResponseBase | None, bool]:
        """Run the view (or the recovery hook) and store its answer in one transaction.

        Return the response and whether it was kept. ``(None, False)``: the lease was taken
        over meanwhile, so the view's writes were rolled back. A response that is not to be
        stored is returned unkept, its writes rolled back too.
        """
        policy = keyed.policy
        with transaction.atomic(using=store.using):
            response = None
            if claim.attempts > 1 and policy.recover is not None:
                # An earlier request with this key did not finish: its effect may have happened.
                response = policy.recover(keyed.view_request, key=keyed.key, attempt=claim.attempts)
            if response is None:
                response = keyed.view()
            if not policy.stores(response.status_code):
                transaction.set_rollback(True, using=store.using)
                return response, False
            if not self._complete(keyed, store, claim, response):
                transaction.set_rollback(True, using=store.using)
                return None, False
        return response, True

    def _superseded(self, keyed: KeyedRequest, store: KeyStore) -> Decision:
        """Answer a request whose key was taken over while it ran with the new owner's answer."""
        logger.error(
            "the lease on idempotency key %s was taken over while its request ran: its writes "
            "were rolled back, and it answers with the new owner's result",
            keyed.key,
        )
        deadline = time.monotonic() + keyed.policy.wait_timeout
        while True:
            found = store.replay(keyed.new_key(self.clock()))
            if (settled := keyed.settled(found)) is not None:
                return settled
            _pause_until(deadline)


class _TimedView:
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


default_engine = Engine()
