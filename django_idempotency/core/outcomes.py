"""What the engine decided for a request, and how a decision is logged and signalled.

Also what the inbox, the outbox and the retry client share to report their own steps: the
fields of a state change, and the hooks that a scheduled retry's delay, and a broker message no
queue took, are reported through.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from django.dispatch import Signal

from django_idempotency import signals
from django_idempotency.core.correlation import LOG_FIELD, from_headers, get_correlation_id

if TYPE_CHECKING:
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


# The state a key moves from and to when a decision changes it; a replay or a refusal changes
# nothing. A response that is not stored releases the key: its row is rolled back or deleted.
_KEY_CHANGES: dict[Outcome, tuple[str, str]] = {
    Outcome.STORED: ("in_progress", "succeeded"),
    Outcome.NOT_STORED: ("in_progress", "released"),
}
#: How many hex digits of the request's fingerprint a decision's log record shows.
FINGERPRINT_PREFIX = 12
# A problem body is small; a body larger than this is not read for its code.
_PROBLEM_MAX_LENGTH = 16 * 1024

#: Sent when the inbox, the outbox or the retry client schedules a retry, with ``component``
#: ("client", "inbox" or "outbox"), ``delay`` (seconds) and ``attempt`` (the one that failed);
#: the client adds ``host`` and ``reason``. The metrics and tracing modules receive it.
retry_scheduled = Signal()


#: Sent when a broker dispatcher finds that no queue takes a message (the broker returned it, or
#: none of the exchange's bindings matches its routing key), with ``exchange`` and ``topic``.
#: The metrics module receives it.
message_unroutable = Signal()


def state_change(from_state: str | None, to_state: str | None) -> dict[str, str | None]:
    """The fields of a log record about an object whose state changes."""
    # A model's status choice logs as its value, whatever the formatter does with enums.
    return {
        "from_state": None if from_state is None else str(from_state),
        "to_state": None if to_state is None else str(to_state),
    }


def report_retry(component: str, delay: float, attempt: int, **details: Any) -> None:
    """Tell the metrics and tracing modules that a retry is scheduled ``delay`` seconds away."""
    if retry_scheduled.has_listeners():
        signals.send_robustly(
            retry_scheduled,
            component,
            component=component,
            delay=max(0.0, delay),
            attempt=attempt,
            **details,
        )


def report_unroutable(exchange: str, topic: str) -> None:
    """Tell the metrics module that no queue took a message published to ``exchange``."""
    if message_unroutable.has_listeners():
        signals.send_robustly(message_unroutable, exchange, exchange=exchange, topic=topic)


@dataclass
class Decision:
    outcome: Outcome
    response: HttpResponseBase | None  # None when the view raised
    key: str | None = None
    scope: str | None = None
    route: str | None = None
    attempt: int = 1
    error: Exception | None = None
    fingerprint: str | None = None


def _log(decision: Decision, view_request: Any, duration: float, overhead: float) -> None:
    scope_hash = (
        hashlib.sha256(decision.scope.encode()).hexdigest()[:16] if decision.scope else None
    )
    fingerprint = decision.fingerprint
    from_state, to_state = _KEY_CHANGES.get(decision.outcome, (None, None))
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
            "idempotency_fingerprint": fingerprint[:FINGERPRINT_PREFIX] if fingerprint else None,
            "idempotency_problem": _problem_code(decision.response),
            "idempotency_duration_ms": round(duration * 1000, 3),
            "idempotency_overhead_ms": round(overhead * 1000, 3),
            "status_code": decision.response.status_code if decision.response else None,
            # Without the middleware, the request's own header still ties the record to it.
            LOG_FIELD: get_correlation_id() or from_headers(getattr(view_request, "headers", None)),
            **state_change(from_state, to_state),
        },
    )


def _problem_code(response: HttpResponseBase | None) -> str | None:
    """The ``code`` of a problem+json response (ours, or a view's), else ``None``."""
    if response is None or response.streaming:
        return None
    if not response.get("Content-Type", "").startswith("application/problem+json"):
        return None
    content: bytes = getattr(response, "content", b"")
    if len(content) > _PROBLEM_MAX_LENGTH:
        return None
    try:
        code = json.loads(content).get("code")
    except (ValueError, AttributeError):  # not JSON, or not an object
        return None
    return code if isinstance(code, str) else None


def report(
    decision: Decision,
    sender: Any,
    view_request: Any,
    duration: float,
    view_seconds: float,
) -> None:
    overhead = max(0.0, duration - view_seconds)
    if logger.isEnabledFor(logging.INFO):
        _log(decision, view_request, duration, overhead)
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
