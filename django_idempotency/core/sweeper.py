"""The sweeper: settle the leases that ran out, asking each view's reconcile hook first.

What a hook answers, and what becomes of the key, is told in ``django_idempotency.reconcile``.
A per-view hook is the one its adapter registered (``core/hooks.py``) for the view of the URL
pattern that the key records, and for its method where the view dispatches each method to its
own operation (Django Ninja's).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.models import F, Q
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from django_idempotency.conf import idempotency_settings, resolve_callable
from django_idempotency.core import hooks
from django_idempotency.core.rows import Claim
from django_idempotency.core.store import KeyStore, key_store
from django_idempotency.reconcile import (
    ExpiredKey,
    NothingHappened,
    Reconciled,
    Result,
    SweepResult,
    Unknown,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from datetime import datetime

    from django.db.models import Model

logger = logging.getLogger("django_idempotency")

IN_PROGRESS = "in_progress"

# A key the hook could not settle, and that nobody took over since (that would raise its
# lease version): it waits for a person. Such a key keeps its expired locked_until, so the
# partial lease index finds it, not a walk of the whole table.
NEEDS_ATTENTION = Q(
    locked_until__isnull=False, state=IN_PROGRESS, unsettled_lease_version=F("lease_version")
)


def _join(prefix: str, route: str) -> str:
    # As Django's URLResolver joins the routes it matched into ResolverMatch.route.
    return prefix + (route[1:] if route.startswith("^") else route)


def hooks_by_route(
    urlconf: str | None = None,
) -> dict[tuple[str, str | None], Callable[[ExpiredKey], Result]]:
    """The per-view hooks of the project's URLconf, by the URL pattern a key records and its
    method (``None``: any method), as the adapters registered them."""
    found: dict[tuple[str, str | None], Callable[[ExpiredKey], Result]] = {}

    def walk(patterns: Iterable[Any], prefix: str) -> None:
        for pattern in patterns:
            route = _join(prefix, str(pattern.pattern))
            if isinstance(pattern, URLResolver):
                walk(pattern.url_patterns, route)
            elif isinstance(pattern, URLPattern):
                for method, hook in hooks.hooks_of(pattern.callback).items():
                    name = f"{route}: reconcile" if method is None else f"{method} {route}"
                    found.setdefault((route, method), resolve_callable(hook, name))

    walk(get_resolver(urlconf).url_patterns, "")
    return found


def sweep(model: type[Model], using: str, now: datetime, batch_size: int) -> SweepResult:
    """Settle ``model``'s leases that ran out by ``now``: ask their hook, or release them."""
    store = key_store(model, using)
    result = SweepResult()
    default = idempotency_settings.RECONCILE
    by_route = hooks_by_route()
    if default is None and not by_route:
        while True:
            count = store.release_expired(now, limit=batch_size)
            result.released += count
            if count < batch_size:
                return result

    def hook_of(row: Any) -> Callable[[ExpiredKey], Result] | None:
        found = by_route.get((row.route, row.method)) or by_route.get((row.route, None))
        return found or default

    after: tuple[datetime, int] | None = None
    while True:
        rows = _expired_leases(store, now, batch_size, after)
        released = [row for row in rows if hook_of(row) is None]
        if released:
            ids = [row.pk for row in released]
            result.released += store.release_expired(now, limit=len(ids), ids=ids)
        for row in rows:
            if (hook := hook_of(row)) is not None:
                outcome = _settle(store, row, hook, now)
                setattr(result, outcome, getattr(result, outcome) + 1)
        if len(rows) < batch_size:
            return result
        after = (rows[-1].locked_until, rows[-1].pk)


def _settle(store: KeyStore, row: Any, hook: Callable[[ExpiredKey], Result], now: datetime) -> str:
    """Take the key over, ask ``hook``, and store what it says; fenced like a request's result."""
    timeout = idempotency_settings.RECONCILE_TIMEOUT
    # Like a retry, the sweeper takes the expired lease over: the dead request is fenced out,
    # another sweeper skips the key, and a retry meanwhile waits (or is told to come back).
    claim = _take_over_expired(store, row, now, timezone.now() + timeout)
    if claim is None:
        return "taken"
    expired = ExpiredKey(
        row.scope, row.key, row.route, row.method, row.fingerprint, row.attempts, row.created_at
    )
    answer = _ask(hook, expired, timeout.total_seconds())
    if isinstance(answer, Reconciled):
        headers, body = answer.stored()
        with transaction.atomic(using=store.using):
            done = store.complete(
                claim, status=answer.status, headers=headers, body=body, now=timezone.now()
            )
        _log("reconciled" if done else "taken", row)
        return "reconciled" if done else "taken"
    if isinstance(answer, NothingHappened):
        released = store.fail(claim)
        _log("released" if released else "taken", row)
        return "released" if released else "taken"
    # The lease goes back to how the dead request left it: expired, so that a retry takes the
    # key over at once (asking the view's recovery hook, as without this one).
    if isinstance(answer, Unknown):
        marked = _give_back(store, claim, row.locked_until, unsettled=True)
        _log("unknown" if marked else "taken", row, answer.reason)
        return "unknown" if marked else "taken"
    _give_back(store, claim, row.locked_until, unsettled=False)
    return "errors"


# Each expired lease is taken over by a compare-and-set of its own, so that no lock is held
# while a hook is asked; the ORM writes these.


def _expired_leases(
    store: KeyStore, now: datetime, limit: int, after: tuple[datetime, int] | None
) -> list[Any]:
    """The next leases that ran out by ``now``, oldest first, not left for a person; read
    without a lock. ``after``: the last one read, as (``locked_until``, id)."""
    rows = (
        store.model._default_manager.using(store.using)
        .filter(state="in_progress", locked_until__lte=now)
        .exclude(unsettled_lease_version=F("lease_version"))
    )
    if after is not None:
        moment, pk = after
        rows = rows.filter(Q(locked_until__gt=moment) | Q(locked_until=moment, pk__gt=pk))
    return list(rows.order_by("locked_until", "pk")[:limit])


def _take_over_expired(store: KeyStore, row: Any, now: datetime, until: datetime) -> Claim | None:
    """Raise the expired lease's version and hold it until ``until``, if it is still as
    read: the dead request is fenced out, and a retry meanwhile waits.

    The row is locked by its primary key alone, then changed by it: a condition on the lease
    in the UPDATE itself lets MariaDB lock a range of the lease index, which deadlocks with
    a retry taking a neighbouring key over.
    """
    keys = store.model._default_manager.using(store.using)
    claim = Claim(row.pk, row.lease_version + 1, row.attempts, row.expires_at)
    if store.connection.vendor == "sqlite":
        # One conditional UPDATE: SQLite locks the whole database, and refuses at once
        # ("database is locked") to turn a transaction that has read into a writer while
        # another writes.
        changed = keys.filter(
            pk=row.pk, lease_version=row.lease_version, state="in_progress",
            locked_until__lte=now,
        ).update(lease_version=claim.lease_version, locked_until=until)  # fmt: skip
        return claim if changed else None
    with transaction.atomic(using=store.using):
        found = keys.select_for_update().filter(pk=row.pk)
        current = found.values_list("lease_version", "state", "locked_until").first()
        if current is None:
            return None  # purged meanwhile
        version, state, locked_until = current
        if version != row.lease_version or state != "in_progress" or locked_until is None:
            return None
        if locked_until > now:
            return None  # renewed by a live request, or taken over by a retry
        keys.filter(pk=row.pk).update(lease_version=claim.lease_version, locked_until=until)
        return claim


def _give_back(store: KeyStore, claim: Claim, locked_until: datetime, *, unsettled: bool) -> bool:
    """Put a lease taken over by ``_take_over_expired()`` back as it was, expired, so that a
    retry takes the key over at once; ``unsettled``: and leave it for a person."""
    mine = store.model._default_manager.using(store.using).filter(
        pk=claim.id, lease_version=claim.lease_version, state="in_progress"
    )
    left = {"unsettled_lease_version": claim.lease_version} if unsettled else {}
    return bool(mine.update(locked_until=locked_until, **left))


def _log(outcome: str, row: Any, reason: str = "") -> None:
    logger.log(
        logging.WARNING if outcome == "unknown" else logging.INFO,
        "reconciling the expired lease on idempotency key %s (%s): %s%s",
        row.key,
        row.route,
        outcome,
        f" ({reason})" if reason else "",
        extra={"idempotency_key": row.key, "idempotency_reconciled": outcome},
    )


class _Asker:
    """A daemon thread that runs hooks one at a time, for one sweeping thread.

    A thread, so that the wait for a hook can be bounded; a lasting one, so that what a hook
    keeps per thread (an HTTP client's connections, say) is reused from one key to the next
    rather than left behind by a thread per key. A hook that overruns keeps its thread: the
    next key gets a new one.
    """

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event]]
        self.jobs = queue.SimpleQueue()
        self.stuck = False
        self.thread = threading.Thread(target=self._run, name="idempotency-reconcile", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            work, answer, done = self.jobs.get()
            try:
                answer["result"] = work()
            except Exception as exc:  # logged by the sweeper's thread
                answer["error"] = exc
            finally:
                connections.close_all()  # this thread's own, if the hook used the database
                done.set()

    def ask(self, work: Callable[[], Any], timeout: float) -> dict[str, Any] | None:
        """Run ``work``; its result or error, or ``None`` if it did not finish in time."""
        answer: dict[str, Any] = {}
        done = threading.Event()
        self.jobs.put((work, answer, done))
        if done.wait(timeout):
            return answer
        self.stuck = True
        return None


_askers = threading.local()


def _asker() -> _Asker:
    asker: _Asker | None = getattr(_askers, "asker", None)
    # Not alive: this process was forked (a Celery prefork worker) after it made the thread.
    if asker is None or asker.stuck or not asker.thread.is_alive():
        asker = _askers.asker = _Asker()
    return asker


def _ask(hook: Callable[[ExpiredKey], Result], expired: ExpiredKey, timeout: float) -> Any:
    """Call ``hook`` in the asking thread, waiting at most ``timeout`` seconds for it.

    ``None`` if it raised, did not answer in time, or answered something else than a result;
    each is logged. A hook that overruns goes on in its thread, unheard: the lease it was asked
    about is given back meanwhile, so whatever it finds is stored by nobody.
    """
    answer = _asker().ask(lambda: hook(expired), timeout)
    if answer is None:
        logger.error(
            "the reconcile hook did not answer within %s s for idempotency key %s; it is "
            "asked again on the next sweep",
            f"{timeout:g}",
            expired.key,
        )
        return None
    if "error" in answer:
        error = answer["error"]
        logger.error(
            "the reconcile hook failed for idempotency key %s; it is asked again on the next sweep",
            expired.key,
            exc_info=(type(error), error, error.__traceback__),
        )
        return None
    result = answer["result"]
    if isinstance(result, Reconciled) and not 100 <= result.status < 500:
        logger.error(
            "the reconcile hook answered status %s for idempotency key %s: only a response "
            "that would be stored (below 500) settles a key",
            result.status,
            expired.key,
        )
        return None
    if not isinstance(result, Reconciled | NothingHappened | Unknown):
        logger.error(
            "the reconcile hook answered %r for idempotency key %s, not Reconciled, "
            "NothingHappened or Unknown",
            result,
            expired.key,
        )
        return None
    return result
