"""Reconciling stuck leases: the sweeper asks downstream what became of a dead request's effect.

A lease-mode request that died (a killed worker) leaves its key in progress until its lease runs
out. Without a hook the sweeper releases such a key, and the client's retry asks the view's
recovery hook. With a ``RECONCILE`` hook the sweeper asks first, for each expired lease:

- ``Reconciled(status, headers, body)``: the effect happened and this is its answer; it is
  stored as the key's response, so the client's retry replays it;
- ``NothingHappened()``: the key is released, as without a hook;
- ``Unknown()``: the key is left in progress for a person, marked so that the sweeper does not
  ask again and the admin and the metrics show it ("needs attention").

A hook that raises or does not answer within ``RECONCILE_TIMEOUT`` leaves its key as it was, for
the next run. The per-view hook (the ``reconcile`` option, ``idempotency_reconcile`` on a DRF
view) is found through the URL pattern recorded on the key: the sweeper runs in a process
(a Celery worker, cron) where no request was ever served, and the URLconf is what every process
of the project shares. The sweeper itself is ``django_idempotency.core.sweeper``.

Reconciling is not recovering: a view's recovery hook (``recover``) is asked by the retry of a
key whose request died, on the request path and with that request; the reconcile hook is asked
by the sweeper, where there is no request, when no retry came before the lease ran out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from django_idempotency.core.responses import capture
from django_idempotency.keys import downstream_key

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping
    from datetime import datetime

    from django.http import HttpResponseBase

__all__ = [
    "ExpiredKey",
    "NothingHappened",
    "Reconciled",
    "SweepResult",
    "Unknown",
]


@dataclass(frozen=True)
class ExpiredKey:
    """What the sweeper tells a hook about a key whose lease ran out."""

    scope: str
    key: str
    route: str
    method: str
    fingerprint: str
    attempts: int  # requests that started running the key
    created_at: datetime

    @property
    def downstream_key(self) -> str:
        """The key the request's view gave a downstream service: ask it by this one."""
        return downstream_key(self.scope, self.key)


@dataclass(frozen=True)
class Reconciled:
    """The effect happened: store this response for the key, so that its retry replays it."""

    status: int
    headers: Mapping[str, str] | Iterable[tuple[str, str]] = ()
    body: bytes | str = b""

    @classmethod
    def of(cls, response: HttpResponseBase) -> Reconciled:
        """The response a view would have answered, as the key stores it."""
        headers, body = capture(response)
        return cls(response.status_code, headers, body)

    def stored(self) -> tuple[list[tuple[str, str]], bytes]:
        headers = self.headers.items() if hasattr(self.headers, "items") else self.headers
        body = self.body.encode() if isinstance(self.body, str) else bytes(self.body)
        return [(str(name), str(value)) for name, value in headers], body


@dataclass(frozen=True)
class NothingHappened:
    """The effect did not happen: release the key, so that its retry runs the view."""


@dataclass(frozen=True)
class Unknown:
    """Nobody can tell yet: leave the key for a person."""

    reason: str = ""


Result = Reconciled | NothingHappened | Unknown


@dataclass
class SweepResult:
    """What one sweep did with the expired leases it found."""

    released: int = 0  # no hook, or the hook said nothing happened
    reconciled: int = 0  # the hook's response stored
    unknown: int = 0  # left for a person
    errors: int = 0  # the hook raised or timed out: left for the next run
    taken: int = 0  # another sweeper or a retry had the key first

    @property
    def settled(self) -> int:
        return self.released + self.reconciled
