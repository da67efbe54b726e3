"""What the engine decided for a request, and how a decision is logged and signalled."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from django_idempotency import signals

if TYPE_CHECKING:
    from django.dispatch import Signal
    from django.http import HttpResponseBase

logger = logging.getLogger("django_idempotency")


class Outcome(StrEnum):
    STORED = "stored"
    REPLAYED = "replayed"
    MISMATCH = "mismatch"
    IN_PROGRESS = "in_progress"
    MISSING = "missing"
    INVALID = "invalid"
    NOT_STORED = "not_stored"
    UNAVAILABLE = "unavailable"


_SIGNALS: dict[Outcome, Signal] = {
    Outcome.STORED: signals.key_stored,
    Outcome.REPLAYED: signals.key_replayed,
    Outcome.MISMATCH: signals.payload_mismatch,
    Outcome.IN_PROGRESS: signals.request_in_progress,
    Outcome.MISSING: signals.key_missing,
    Outcome.INVALID: signals.key_invalid,
    Outcome.NOT_STORED: signals.response_not_stored,
    Outcome.UNAVAILABLE: signals.database_unavailable,
}


@dataclass
class Decision:
    outcome: Outcome
    response: HttpResponseBase | None  # None when the view raised
    key: str | None = None
    scope: str | None = None
    route: str | None = None
    attempt: int = 1
    error: Exception | None = None


def _log(decision: Decision, duration: float, overhead: float) -> None:
    scope_hash = (
        hashlib.sha256(decision.scope.encode()).hexdigest()[:16] if decision.scope else None
    )
    # Never the body, never a header value: only what identifies the decision.
    logger.info(
        "idempotency %s: key=%s route=%s",
        decision.outcome,
        decision.key,
        decision.route,
        extra={
            "idempotency_outcome": str(decision.outcome),
            "idempotency_key": decision.key,
            "idempotency_scope": scope_hash,
            "idempotency_route": decision.route,
            "idempotency_attempt": decision.attempt,
            "idempotency_duration_ms": round(duration * 1000, 3),
            "idempotency_overhead_ms": round(overhead * 1000, 3),
            "status_code": decision.response.status_code if decision.response else None,
        },
    )


def report(
    decision: Decision,
    sender: Any,
    view_request: Any,
    duration: float,
    view_seconds: float,
) -> None:
    overhead = max(0.0, duration - view_seconds)
    if logger.isEnabledFor(logging.INFO):
        _log(decision, duration, overhead)
    # The decision is made (and maybe committed): a failing receiver must not undo the answer.
    signals.send_robustly(
        _SIGNALS[decision.outcome],
        sender,
        request=view_request,
        key=decision.key,
        scope=decision.scope,
        route=decision.route,
        response=decision.response,
        outcome=str(decision.outcome),
        attempt=decision.attempt,
        overhead=overhead,
    )
