"""A key's row as the store reads it, and what the store hands back: a claim, a stored
response, the conflict that refuses a request, or a wait on another request that ran out.

A row may be taken over when it is free: expired, failed, or (for a retry of its own request)
leased by a request whose lease ran out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from django_idempotency.core.statements import Holder


# How often a request that waits for another one holding its key looks at the key again; on
# PostgreSQL an atomic-mode duplicate looks first after 5 ms, then twice as long each time up to
# that: most requests hold their key for a few milliseconds.
POLL_SECONDS = 0.05
FIRST_POLL_SECONDS = 0.005


class KeyBusy(Exception):
    """Another request holds the key and did not finish within the wait bound."""


@dataclass(frozen=True, kw_only=True)
class NewKey:
    """The row a request claims: its key, what the request is, and how long it lives."""

    scope: str
    key: str
    method: str
    route: str
    fingerprint: str
    now: datetime
    expires_at: datetime
    wait_timeout: float  # for a concurrent request that holds the key
    locked_until: datetime | None = None  # lease mode


@dataclass(frozen=True)
class Claim:
    """A key row this request owns until it completes; ``lease_version`` fences the final write."""

    id: int
    lease_version: int
    attempts: int  # above 1: an earlier request with this key did not finish
    expires_at: datetime


@dataclass(frozen=True)
class Reservation(Claim):
    """A key that this transaction holds the advisory lock on, with no row written yet: the row
    is written once, completed (see ``PostgreSQLKeyStore``).

    ``id`` is the free row's that the completion takes over (0 if none; no row has id 0);
    ``lease_version`` and ``attempts`` are the ones the completed row will have.
    """

    new: NewKey


@dataclass(frozen=True)
class StoredResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    replay_count: int
    expires_at: datetime | None = None


@dataclass(frozen=True)
class Conflict:
    """A live row holds the key and cannot be replayed for this request."""

    fingerprint_matches: bool


def aware(value: datetime | str) -> datetime:
    # SQLite hands back text in UTC; PostgreSQL an aware datetime.
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def stored_response(row: Holder) -> StoredResponse:
    headers = row.response_headers
    if isinstance(headers, str):  # Django loads JSON columns as text
        headers = json.loads(headers)
    return StoredResponse(
        status=cast("int", row.response_status),
        headers=[(name, value) for name, value in headers or []],
        body=bytes(row.response_body or b""),
        replay_count=row.replay_count,
        expires_at=aware(row.expires_at),
    )


def claimed(returned: tuple[Any, ...], new: NewKey) -> Claim:
    # What a claiming statement returns; PostgreSQL's adds the lock_timeout it put back.
    id_, lease_version, attempts = returned[:3]
    return Claim(id_, lease_version, attempts, new.expires_at)


def is_free(row: Holder, new: NewKey) -> bool:
    """Whether ``new`` may take over the key's ``row``: it expired or failed, or its request's
    lease ran out and ``new`` is a retry of that request. That request may have had its effect:
    a request with another payload is refused, as when the row was live."""
    return (
        aware(row.expires_at) <= new.now
        or row.state == "failed"
        or (lease_ran_out(row, new) and row.fingerprint == new.fingerprint)
    )


def lease_ran_out(row: Holder, new: NewKey) -> bool:
    # Only a running lease-mode request's row has locked_until: completing or failing clears it.
    return row.locked_until is not None and aware(row.locked_until) <= new.now
