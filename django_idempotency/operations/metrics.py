"""Prometheus metrics: loaded by the app when prometheus-client is installed.

The metrics are registered in prometheus-client's default registry, so whatever exposes that
registry (django-prometheus's ``/metrics`` view, ``prometheus_client.make_wsgi_app()``, or the
example project's view) exposes them too:

- ``django_idempotency_requests_total{outcome, route}``: decisions on requests with (or
  missing) a key, by outcome (``stored``, ``replayed``, ``mismatch``, ``in_progress``,
  ``missing``, ``invalid``, ``not_stored``, ``unavailable``) and URL pattern;
- ``django_idempotency_overhead_seconds{outcome}``: what the library added to each of those
  requests, the view's own time left out;
- ``django_idempotency_inbox_events_total{source, outcome}``: webhook inbox steps
  (``received``, ``duplicate``, ``conflict``, ``processed``, ``failed``, ``dead``);
- ``django_idempotency_retry_delay_seconds{component}``: the delay of each retry scheduled by
  the retry client, the inbox or the outbox;
- ``django_idempotency_client_retries_total{host, reason}``: the retry client's retries;
- ``django_idempotency_inbox_refused_total{source, reason}``: deliveries refused before
  anything was recorded, by the problem's code (``inbox.signature_invalid`` for a forged or
  tampered one, ``inbox.signature_expired``, ``inbox.payload_too_large``, …);
- ``django_idempotency_tasks_total{outcome, task}``: runs of idempotent tasks (Celery's and the
  Tasks framework's), by outcome (``stored``, ``replayed``, ``mismatch``, ``in_progress``,
  ``not_stored``) and task;
- ``django_idempotency_lease_renewals_total``: leases of running lease-mode requests renewed;
- ``django_idempotency_lease_takeovers_total{route}``: keys taken over by a retry after their
  lease ran out, by URL pattern (or task name);
- ``django_idempotency_replay_cache_errors_total{operation}``: replay cache calls that failed
  (``get`` or ``set``), the database answering instead;
- read from the database at each scrape: ``django_idempotency_stuck_leases`` (lease-mode keys
  whose lease ran out), ``django_idempotency_unsettled_leases`` (keys the reconcile hook
  could not settle, waiting for a person), ``django_idempotency_inbox_due_events``,
  ``django_idempotency_inbox_dead_events``, ``django_idempotency_outbox_due_messages``,
  ``django_idempotency_outbox_dead_messages``, and the ages of the oldest due:
  ``django_idempotency_inbox_oldest_due_seconds`` and
  ``django_idempotency_outbox_oldest_due_seconds``;
- ``django_idempotency_scrape_errors_total``: scrapes whose database reads failed, which left
  those gauges out;
- read from the retry client's circuit breakers at each scrape, when the client is installed:
  ``django_idempotency_client_circuits{host, state}`` (circuits in each state: ``closed``,
  ``open``, ``half_open``), ``django_idempotency_client_circuit_opened_total{host}`` and
  ``django_idempotency_client_circuit_rejected_total{host}`` (requests failed fast).

Under prometheus-client's multiprocess mode the registry served is a new one, without the
database gauges: ``register_database_gauges()`` adds them to it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from django import db
from django.db import router
from django.db.models import Q
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.core import optional, outcomes
from django_idempotency.core.sweeper import NEEDS_ATTENTION
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage

with optional.requires("metrics", __name__):
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

# The client's extra may be missing: then there are no circuits to report.
_CLIENT = optional.installed(optional.EXTRAS["client"].module)
if _CLIENT:
    from django_idempotency.client import CIRCUIT_STATES, all_breakers

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from datetime import datetime

    from django.db.models import Model, QuerySet
    from prometheus_client import Metric

logger = logging.getLogger("django_idempotency")

REQUESTS = Counter(
    "django_idempotency_requests",
    "Idempotency decisions, by outcome and route.",
    ["outcome", "route"],
)
OVERHEAD = Histogram(
    "django_idempotency_overhead_seconds",
    "Time the idempotency engine added to a request, without the view's own time.",
    ["outcome"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
INBOX_EVENTS = Counter(
    "django_idempotency_inbox_events",
    "Webhook inbox steps, by source and outcome.",
    ["source", "outcome"],
)
TASKS = Counter(
    "django_idempotency_tasks",
    "Idempotent Celery task deliveries, by outcome and task.",
    ["outcome", "task"],
)

RETRY_DELAY = Histogram(
    "django_idempotency_retry_delay_seconds",
    "Delays of the retries scheduled, by component: client, inbox or outbox.",
    ["component"],
    # From the client's fraction of a second to the inbox's and outbox's hours.
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0),
)
CLIENT_RETRIES = Counter(
    "django_idempotency_client_retries",
    "Retries of the retry client, by host and reason.",
    ["host", "reason"],
)


def _count_retry(*, component: str, delay: float, **details: Any) -> None:
    RETRY_DELAY.labels(component=component).observe(delay)
    if component == "client":
        CLIENT_RETRIES.labels(host=details["host"], reason=details["reason"]).inc()


INBOX_REFUSED = Counter(
    "django_idempotency_inbox_refused",
    "Webhook deliveries refused before anything was recorded, by source and reason.",
    ["source", "reason"],
)


LEASE_RENEWALS = Counter(
    "django_idempotency_lease_renewals",
    "Leases of running lease-mode requests renewed by their process.",
)
LEASE_TAKEOVERS = Counter(
    "django_idempotency_lease_takeovers",
    "Keys taken over by a retry after their lease ran out, by route.",
    ["route"],
)
REPLAY_CACHE_ERRORS = Counter(
    "django_idempotency_replay_cache_errors",
    "Replay cache calls that failed, by operation: the database answered instead.",
    ["operation"],
)
# Registered after the backlog's collector (see _connect()), so that a scrape counts its own error.
SCRAPE_ERRORS = Counter(
    "django_idempotency_scrape_errors",
    "Scrapes whose database reads failed: the backlog gauges were left out of them.",
    registry=None,
)


def _count_renewal(**_: Any) -> None:
    LEASE_RENEWALS.inc()


def _count_takeover(*, route: str, **_: Any) -> None:
    LEASE_TAKEOVERS.labels(route=route).inc()


def _count_cache_error(*, operation: str, **_: Any) -> None:
    REPLAY_CACHE_ERRORS.labels(operation=operation).inc()


def _count_decision(*, outcome: str, route: str | None, overhead: float, **_: Any) -> None:
    REQUESTS.labels(outcome=outcome, route=route or "").inc()
    OVERHEAD.labels(outcome=outcome).observe(overhead)


def _count_refusal(*, source: str, reason: str, **_: Any) -> None:
    INBOX_REFUSED.labels(source=source, reason=reason).inc()


def _count_task(*, outcome: str, task: str, **_: Any) -> None:
    TASKS.labels(outcome=outcome, task=task).inc()


def _inbox_receiver(outcome: str) -> Any:
    def count(*, event: InboxEvent, conflict: bool = False, **_: Any) -> None:
        INBOX_EVENTS.labels(source=event.source, outcome="conflict" if conflict else outcome).inc()

    return count


def _count(rows: QuerySet[Any], now: datetime) -> float:
    return rows.count()


def _oldest_due_age(rows: QuerySet[Any], now: datetime) -> float:
    # The first entry of the due index, read in its order: one probe, however long the backlog.
    oldest = rows.order_by("next_attempt_at").values_list("next_attempt_at", flat=True).first()
    return 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds())


class BacklogCollector(Collector):
    """Read, at each scrape, what waits for a person or for the periodic tasks.

    Each gauge reads a small partial index: a count of its entries, or the first of them. A
    scrape whose reads fail leaves the gauges out, counts the failure and logs it; the rest of
    the scrape answers.
    """

    def describe(self) -> Iterable[Metric]:
        # Described without values: registering the collector must not query the database.
        return [GaugeMetricFamily(name, help_text) for name, help_text, *_ in self._gauges()]

    def collect(self) -> Iterable[Metric]:
        now = timezone.now()
        families, aliases = [], set()
        try:
            for name, help_text, model, condition, measure in self._gauges(now):
                aliases.add(alias := router.db_for_read(model))
                rows = model._default_manager.using(alias).filter(condition)
                families.append(GaugeMetricFamily(name, help_text, value=measure(rows, now)))
        except Exception:  # whatever fails, the scrape of every other metric must not
            SCRAPE_ERRORS.inc()
            logger.warning("idempotency metrics: the backlog could not be read", exc_info=True)
            self._close_broken_connections(aliases)
            return []
        return families

    @staticmethod
    def _close_broken_connections(aliases: Iterable[str]) -> None:
        # A scrape served outside a request (prometheus-client's own HTTP server thread) has no
        # request_finished to drop a connection that the database closed: every later scrape
        # would fail on it.
        for alias in aliases:
            connection = db.connections[alias]
            if not connection.in_atomic_block:
                with contextlib.suppress(db.Error):
                    connection.close_if_unusable_or_obsolete()

    @staticmethod
    def _gauges(
        now: datetime | None = None,
    ) -> list[tuple[str, str, type[Model], Q, Callable[[QuerySet[Any], datetime], float]]]:
        now = now or timezone.now()
        inbox_due = Q(next_attempt_at__lte=now)
        outbox_due = Q(status=OutboxMessage.Status.PENDING, next_attempt_at__lte=now)
        return [
            (
                "django_idempotency_stuck_leases",
                "Lease-mode keys whose lease ran out: the sweep will release them.",
                IdempotencyKey,
                Q(state=IdempotencyKey.State.IN_PROGRESS, locked_until__lte=now),
                _count,
            ),
            (
                "django_idempotency_unsettled_leases",
                "Lease-mode keys the reconcile hook could not settle: they wait for a person.",
                IdempotencyKey,
                NEEDS_ATTENTION,
                _count,
            ),
            (
                "django_idempotency_inbox_due_events",
                "Inbox events due to be processed now (new or to retry).",
                InboxEvent,
                inbox_due,
                _count,
            ),
            (
                "django_idempotency_inbox_oldest_due_seconds",
                "How long the inbox event due the longest has waited since it was due; 0 if none.",
                InboxEvent,
                inbox_due,
                _oldest_due_age,
            ),
            (
                "django_idempotency_inbox_dead_events",
                "Inbox events that failed every attempt and wait for a person.",
                InboxEvent,
                Q(status=InboxEvent.Status.DEAD),
                _count,
            ),
            (
                "django_idempotency_outbox_due_messages",
                "Outbox messages due to be sent now.",
                OutboxMessage,
                outbox_due,
                _count,
            ),
            (
                "django_idempotency_outbox_oldest_due_seconds",
                "How long the outbox message due the longest has waited since it was due; 0 if "
                "none.",
                OutboxMessage,
                outbox_due,
                _oldest_due_age,
            ),
            (
                "django_idempotency_outbox_dead_messages",
                "Outbox messages that failed every attempt and wait for a person.",
                OutboxMessage,
                Q(status=OutboxMessage.Status.DEAD),
                _count,
            ),
        ]


def register_database_gauges(registry: CollectorRegistry) -> None:
    """Serve the gauges read from the database from ``registry`` too.

    For prometheus-client's multiprocess mode, whose ``MultiProcessCollector`` serves a registry
    of its own: the default registry, where the app put them, is not served there.
    """
    registry.register(BacklogCollector())


class CircuitCollector(Collector):
    """Report, at each scrape, every host's circuit in the retry client: state and counts."""

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        states, opened, rejected = families
        # Policies with breakers of their own may share a host: their counts add up.
        in_state: collections.Counter[tuple[str, str]] = collections.Counter()
        opens: collections.Counter[str] = collections.Counter()
        rejects: collections.Counter[str] = collections.Counter()
        hosts = set()
        for breaker in all_breakers():
            hosts.add(breaker.host)
            in_state[breaker.host, breaker.state] += 1
            opens[breaker.host] += breaker.opened
            rejects[breaker.host] += breaker.rejected
        for host in sorted(hosts):
            for state in CIRCUIT_STATES:
                states.add_metric([host, state], in_state[host, state])
            opened.add_metric([host], opens[host])
            rejected.add_metric([host], rejects[host])
        return families

    @staticmethod
    def _families() -> list[Any]:
        return [
            GaugeMetricFamily(
                "django_idempotency_client_circuits",
                "Circuits of the retry client, by host and state.",
                labels=["host", "state"],
            ),
            CounterMetricFamily(
                "django_idempotency_client_circuit_opened",
                "Times a host's circuit opened.",
                labels=["host"],
            ),
            CounterMetricFamily(
                "django_idempotency_client_circuit_rejected",
                "Requests failed fast by an open circuit.",
                labels=["host"],
            ),
        ]


# One per attempt: the message stays pending, is retried, and ends dead.
BROKER_UNROUTABLE = Counter(
    "django_idempotency_broker_unroutable",
    "Publishes of outbox messages to a broker that no queue took, by exchange and topic.",
    ["exchange", "topic"],
)


def _count_unroutable(*, exchange: str, topic: str, **_: Any) -> None:
    BROKER_UNROUTABLE.labels(exchange=exchange, topic=topic).inc()


def _connect() -> None:
    outcomes.message_unroutable.connect(
        _count_unroutable, dispatch_uid="django_idempotency.operations.metrics", weak=False
    )
    for signal in signals.DECISION_SIGNALS:
        signal.connect(
            _count_decision, dispatch_uid="django_idempotency.operations.metrics", weak=False
        )
    signals.task_decided.connect(
        _count_task, dispatch_uid="django_idempotency.operations.metrics", weak=False
    )
    for signal, outcome in (
        (signals.inbox_event_received, "received"),
        (signals.inbox_event_duplicate, "duplicate"),
        (signals.inbox_event_processed, "processed"),
        (signals.inbox_event_failed, "failed"),
        (signals.inbox_event_dead, "dead"),
    ):
        signal.connect(
            _inbox_receiver(outcome),
            dispatch_uid="django_idempotency.operations.metrics",
            weak=False,
        )
    outcomes.retry_scheduled.connect(
        _count_retry, dispatch_uid="django_idempotency.operations.metrics", weak=False
    )
    signals.inbox_delivery_refused.connect(
        _count_refusal, dispatch_uid="django_idempotency.operations.metrics", weak=False
    )
    for signal, receiver in (
        (signals.lease_renewed, _count_renewal),
        (signals.lease_taken_over, _count_takeover),
        (signals.replay_cache_failed, _count_cache_error),
    ):
        signal.connect(receiver, dispatch_uid="django_idempotency.operations.metrics", weak=False)
    REGISTRY.register(BacklogCollector())
    REGISTRY.register(SCRAPE_ERRORS)
    if _CLIENT:
        REGISTRY.register(CircuitCollector())


_connect()
