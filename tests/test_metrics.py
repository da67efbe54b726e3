"""Prometheus metrics and OpenTelemetry span attributes, from real requests."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY, generate_latest

from django_idempotency.outbox import publish, relay, relaying
from tests.factories import IdempotencyKeyFactory, InboxEventFactory, OutboxMessageFactory
from tests.inbox import deliver, refund_event

pytestmark = pytest.mark.django_db(transaction=True)


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_decisions_are_counted_by_outcome_and_route(client_alice, key):
    def counts():
        return {
            outcome: sample("django_idempotency_requests_total", outcome=outcome, route="payments/")
            for outcome in ("stored", "replayed", "mismatch", "missing")
        }

    overhead = sample("django_idempotency_overhead_seconds_count", outcome="replayed")
    before = counts()
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    client_alice.send("POST", "/payments/", {"amount": 2}, key=key)
    client_alice.send("POST", "/payments/", {"amount": 2})
    after = counts()

    assert {outcome: after[outcome] - before[outcome] for outcome in after} == {
        "stored": 1,
        "replayed": 1,
        "mismatch": 1,
        "missing": 1,
    }
    assert sample("django_idempotency_overhead_seconds_count", outcome="replayed") == overhead + 1


def test_inbox_steps_are_counted_by_source():
    def count(outcome):
        return sample("django_idempotency_inbox_events_total", source="tests", outcome=outcome)

    received, duplicate, processed = count("received"), count("duplicate"), count("processed")
    payload = refund_event()
    deliver(payload)
    deliver(payload)
    assert count("received") == received + 1
    assert count("processed") == processed + 1
    assert count("duplicate") == duplicate + 1


def test_refused_deliveries_are_counted_by_source_and_reason():
    from django_idempotency.inbox import StandardWebhooksSignature  # noqa: PLC0415

    def count(reason):
        return sample("django_idempotency_inbox_refused_total", source="tests", reason=reason)

    forged = count("inbox.signature_invalid")
    forger = StandardWebhooksSignature(["whsec_" + "Zm9yZ2Vk" * 4])
    assert deliver(refund_event(), signer=forger).status_code == 400
    assert deliver(refund_event(), signer=forger).status_code == 400

    assert count("inbox.signature_invalid") == forged + 2


def test_the_backlog_is_read_from_the_database_at_each_scrape():
    now = timezone.now()
    IdempotencyKeyFactory(lease_expired=True)
    InboxEventFactory(dead=True)
    OutboxMessageFactory(dead=True)
    OutboxMessageFactory(next_attempt_at=now - timedelta(seconds=1))

    assert sample("django_idempotency_stuck_leases") == 1
    assert sample("django_idempotency_inbox_dead_events") == 1
    assert sample("django_idempotency_outbox_dead_messages") == 1
    assert sample("django_idempotency_outbox_due_messages") == 1
    assert b"django_idempotency_inbox_due_events 0.0" in generate_latest(REGISTRY)


def test_a_replay_is_visible_in_its_requests_span(client_alice, key):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tests")

    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    with tracer.start_as_current_span("POST payments/"):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

    (span,) = exporter.get_finished_spans()
    assert span.attributes["idempotency.outcome"] == "replayed"
    assert span.attributes["idempotency.replayed"] is True
    assert span.attributes["idempotency.key"] == key
    assert span.attributes["idempotency.attempt"] == 2
    assert span.attributes["idempotency.overhead_ms"] >= 0


def test_the_inbox_and_outbox_retry_delays_are_measured(monkeypatch):
    monkeypatch.setattr(relaying, "trigger", lambda: None)
    inbox = sample("django_idempotency_retry_delay_seconds_count", component="inbox")
    outbox = sample("django_idempotency_retry_delay_seconds_count", component="outbox")
    # A first retry waits at most INBOX_RETRY_DELAY and OUTBOX_RETRY_DELAY: 30 s.
    inbox_quick = sample(
        "django_idempotency_retry_delay_seconds_bucket", component="inbox", le="30.0"
    )
    outbox_quick = sample(
        "django_idempotency_retry_delay_seconds_bucket", component="outbox", le="30.0"
    )

    deliver(refund_event(fail="always"))
    publish("tests.failing", {"fail_times": "always"})
    relay(random=lambda: 0.5)

    assert sample("django_idempotency_retry_delay_seconds_count", component="inbox") == inbox + 1
    assert sample("django_idempotency_retry_delay_seconds_count", component="outbox") == outbox + 1
    assert (
        sample("django_idempotency_retry_delay_seconds_bucket", component="inbox", le="30.0")
        == inbox_quick + 1
    )
    assert (
        sample("django_idempotency_retry_delay_seconds_bucket", component="outbox", le="30.0")
        == outbox_quick + 1
    )
    # No retry is scheduled for a delivered message or a processed event.
    deliver(refund_event())
    assert sample("django_idempotency_retry_delay_seconds_count", component="inbox") == inbox + 1


def test_an_outbox_retry_is_an_event_on_the_relays_span(monkeypatch):
    monkeypatch.setattr(relaying, "trigger", lambda: None)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    publish("tests.failing", {"fail_times": "always"})

    with provider.get_tracer("tests").start_as_current_span("relay_outbox"):
        relay(random=lambda: 0.5)

    (span,) = exporter.get_finished_spans()
    (event,) = span.events
    assert event.name == "idempotency.retry"
    assert event.attributes["idempotency.retry.component"] == "outbox"
    assert event.attributes["idempotency.retry.attempt"] == 1
    assert 0 < event.attributes["idempotency.retry.delay_ms"] <= 30_000
