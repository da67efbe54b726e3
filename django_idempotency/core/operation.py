"""What the engine runs: an *operation*, made idempotent by its key.

An operation has an identity (its key within its scope, a method, a route or task name, and a
fingerprint of what it is asked to do), a body to run once, and a way to turn what the body
produced into the key row's stored response and back. A view's request (``keyed_request.py``)
and a Celery task's delivery (``celery.py``) are operations; so will be any adapter to come.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from django_idempotency.core.rows import NewKey
from django_idempotency.core.tables import ROUTE_LENGTH, SCOPE_LENGTH

if TYPE_CHECKING:
    from datetime import datetime, timedelta

    from django_idempotency.conf import Mode
    from django_idempotency.core.cache import ReplayCache
    from django_idempotency.core.outcomes import Outcome
    from django_idempotency.core.rows import StoredResponse
    from django_idempotency.keys import ScopedKey


R = TypeVar("R")


def fit_scope(scope: str) -> str:
    """Keep a long scope unique but within its column: replace it by its digest."""
    if len(scope) <= SCOPE_LENGTH:
        return scope
    return "sha256:" + hashlib.sha256(scope.encode()).hexdigest()


@dataclass(frozen=True)
class Record:
    """What is stored of an operation's result, in the key row's response columns."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes


class Operation(ABC, Generic[R]):
    """What the engine makes idempotent: a body run once per key, and its stored result.

    An adapter says who the operation is (its key within its scope, method, route, fingerprint,
    mode and timeouts), runs its body, and turns the body's result into the key row's response
    and back, so that a duplicate gets the same answer.
    """

    key: ScopedKey
    method: str
    route: str
    fingerprint: str
    mode: Mode
    ttl: timedelta
    wait_timeout: float
    lease_timeout: timedelta
    cache: ReplayCache | None = None
    #: Why a lease-mode operation refuses to start inside a transaction, in its users' words.
    lease_in_transaction: ClassVar[str]

    @property
    def scope(self) -> str:
        return self.key.scope

    def new_key(self, now: datetime) -> NewKey:
        """The key row this operation claims at ``now``."""
        lease = self.mode == "lease"
        return NewKey(
            scope=self.scope,
            key=self.key,
            method=self.method,
            route=self.route[:ROUTE_LENGTH],  # shown in the admin; the scope holds it whole
            fingerprint=self.fingerprint,
            now=now,
            expires_at=now + self.ttl,
            wait_timeout=self.wait_timeout,
            locked_until=now + self.lease_timeout if lease else None,
        )

    @abstractmethod
    def run(self, attempt: int) -> R:
        """Run the body; ``attempt`` counts the runs of this key, this one included."""

    def recover(self, attempt: int) -> R | None:
        """Lease mode, before a key whose earlier run did not finish runs again: the result of
        that run if its effect happened, else ``None`` to run the body."""
        return None

    @abstractmethod
    def keeps(self, result: R) -> bool:
        """Whether ``result`` is stored; if not, its writes roll back and the key is released."""

    @abstractmethod
    def encode(self, result: R) -> Record:
        """What is stored of ``result``."""

    @abstractmethod
    def decode(self, stored: StoredResponse) -> R:
        """The result a duplicate gets from the stored row."""


@dataclass(frozen=True)
class Answer(Generic[R]):
    """What became of an operation: its outcome, and the result it answers with, if any."""

    outcome: Outcome  # stored, not_stored, replayed, mismatch or in_progress
    result: R | None = None  # the body's; or, replayed, the stored one decoded
    attempt: int = 1
