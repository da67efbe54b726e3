"""OpenTelemetry: loaded by the app when opentelemetry-api is installed.

Each decision on a request with (or missing) an idempotency key is recorded on the current span,
usually the request's span made by opentelemetry-instrumentation-django:
``idempotency.outcome`` (``stored``, ``replayed``, …), ``idempotency.key`` (when there is a valid
one), ``idempotency.attempt``, ``idempotency.replayed`` and ``idempotency.overhead_ms``. Without
an SDK configured, the current span records nothing and this costs next to nothing.

Each retry that the retry client, the inbox or the outbox schedules is an ``idempotency.retry``
event on the current span: the span of the code that sent the request, or of the task that
processed the event or relayed the message.
"""

from __future__ import annotations

from typing import Any

from django_idempotency import signals
from django_idempotency.core import optional, outcomes

with optional.requires("tracing", __name__):
    from opentelemetry import trace


def _annotate(*, outcome: str, key: str | None, attempt: int, overhead: float, **_: Any) -> None:
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes: dict[str, str | int | float | bool] = {
        "idempotency.outcome": outcome,
        "idempotency.attempt": attempt,
        "idempotency.replayed": outcome == "replayed",
        "idempotency.overhead_ms": round(overhead * 1000, 3),
    }
    if key is not None:
        attributes["idempotency.key"] = key
    span.set_attributes(attributes)


for _signal in signals.DECISION_SIGNALS:
    _signal.connect(_annotate, dispatch_uid="django_idempotency.operations.tracing", weak=False)


def _retry_event(*, component: str, delay: float, attempt: int, **details: Any) -> None:
    span = trace.get_current_span()
    if not span.is_recording():
        return
    attributes: dict[str, str | int | float] = {
        "idempotency.retry.component": component,
        "idempotency.retry.attempt": attempt,
        "idempotency.retry.delay_ms": round(delay * 1000, 3),
    }
    if "reason" in details:
        attributes["idempotency.retry.reason"] = details["reason"]
    if "host" in details:
        attributes["server.address"] = details["host"]
    span.add_event("idempotency.retry", attributes)


outcomes.retry_scheduled.connect(
    _retry_event, dispatch_uid="django_idempotency.operations.tracing", weak=False
)
