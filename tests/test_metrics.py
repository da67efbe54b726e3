"""Prometheus metrics and OpenTelemetry span attributes, from real requests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import OperationalError, connection, transaction
from django.test import override_settings
from django.utils import timezone
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from django_idempotency.core.leases import leases
from django_idempotency.core.rows import Conflict, NewKey
from django_idempotency.core.store import key_store
from django_idempotency.models import IdempotencyKey
from django_idempotency.operations.metrics import register_database_gauges
from django_idempotency.outbox import publish, relay, relaying
from tests.conftest import BEHIND_PGBOUNCER
from tests.factories import IdempotencyKeyFactory, InboxEventFactory, OutboxMessageFactory
from tests.inbox import deliver, refund_event

ROOT = Path(__file__).resolve().parent.parent

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
    from django_idempotency.signing import StandardWebhooksSignature  # noqa: PLC0415

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


# --- leases -------------------------------------------------------------------------------------


def lease_key(key, now, lease, fingerprint="f" * 64):
    return NewKey(
        scope="metrics", key=key, method="POST", route="metrics/leases/", fingerprint=fingerprint,
        now=now, expires_at=now + timedelta(hours=24), wait_timeout=1, locked_until=now + lease,
    )  # fmt: skip


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_running_requests_renewed_lease_is_counted():
    store = key_store(IdempotencyKey, "default")
    lease = timedelta(seconds=0.6)
    now = timezone.now()
    claim = store.claim(lease_key("renewed", now, lease))
    renewals = sample("django_idempotency_lease_renewals_total")

    # The process's lease thread renews it every third of the lease, on a connection of its own.
    with leases.keep(store, claim, "renewed", lease):
        wait_for(lambda: sample("django_idempotency_lease_renewals_total") > renewals)

    assert IdempotencyKey.objects.get().locked_until > now + lease  # it really was extended


def test_a_lease_no_longer_its_requests_is_not_counted_as_renewed():
    store = key_store(IdempotencyKey, "default")
    lease = timedelta(seconds=0.3)
    claim = store.claim(lease_key("completed", timezone.now(), lease))
    store.complete(claim, status=201, headers=[], body=b"", now=timezone.now())
    renewals = sample("django_idempotency_lease_renewals_total")

    with leases.keep(store, claim, "completed", lease):
        time.sleep(0.35)  # the thread tried twice, and found the key completed

    assert sample("django_idempotency_lease_renewals_total") == renewals


def test_a_retry_that_takes_over_a_lease_that_ran_out_is_counted_by_route():
    def takeovers():
        return sample("django_idempotency_lease_takeovers_total", route="metrics/leases/")

    store = key_store(IdempotencyKey, "default")
    lease = timedelta(seconds=1)
    now = timezone.now()
    before = takeovers()
    store.acquire(lease_key("died", now, lease))
    retry = store.acquire(lease_key("died", now + 2 * lease, lease))  # the lease ran out

    assert (retry.lease_version, retry.attempts) == (2, 2)
    assert takeovers() == before + 1


def test_a_takeover_rolled_back_or_of_a_released_key_is_not_counted():
    def takeovers():
        return sample("django_idempotency_lease_takeovers_total", route="metrics/leases/")

    store = key_store(IdempotencyKey, "default")
    lease = timedelta(seconds=1)
    now = timezone.now()
    before = takeovers()
    store.acquire(lease_key("rolled-back", now, lease))
    with transaction.atomic():
        assert store.acquire(lease_key("rolled-back", now + 2 * lease, lease)).attempts == 2
        transaction.set_rollback(True)  # the claim's transaction failed: nothing was taken over
    released = store.acquire(lease_key("released", now, lease))
    store.fail(released)  # the request failed and gave its key back
    assert store.acquire(lease_key("released", now, lease)).attempts == 2
    store.acquire(lease_key("live", now, lease))
    assert isinstance(store.acquire(lease_key("live", now, lease)), Conflict)

    assert takeovers() == before


# --- the replay cache ---------------------------------------------------------------------------


def test_replay_cache_errors_are_counted_by_operation(client_alice, key):
    def errors(operation):
        return sample("django_idempotency_replay_cache_errors_total", operation=operation)

    gets, sets = errors("get"), errors("set")
    down = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        # Nothing listens there: each call is refused at once.
        "down": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
        },
    }
    with override_settings(CACHES=down, IDEMPOTENCY={"CACHE": "down"}):
        first = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        second = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

    assert (first["Idempotency-Status"], second["Idempotency-Status"]) == ("stored", "replayed")
    assert errors("get") == gets + 2  # each request looked in the cache first
    assert errors("set") == sets + 1  # and the replay tried to put its answer there


# --- what a scrape reads from the database ------------------------------------------------------


def test_the_oldest_due_gauges_are_the_age_of_the_event_and_message_due_the_longest():
    now = timezone.now()
    InboxEventFactory(next_attempt_at=now - timedelta(seconds=30))
    InboxEventFactory(failed=True, next_attempt_at=now - timedelta(seconds=120))
    InboxEventFactory(claimed=True)  # due only if its attempt does not finish
    InboxEventFactory(processed=True, received_at=now - timedelta(hours=2))
    OutboxMessageFactory(next_attempt_at=now - timedelta(seconds=90))
    OutboxMessageFactory(scheduled=True)
    OutboxMessageFactory(sent=True, created_at=now - timedelta(hours=2))

    inbox = sample("django_idempotency_inbox_oldest_due_seconds")
    outbox = sample("django_idempotency_outbox_oldest_due_seconds")
    waited = (timezone.now() - now).total_seconds()

    assert 120 <= inbox <= 120 + waited
    assert 90 <= outbox <= 90 + waited


def test_the_oldest_due_gauges_are_0_when_nothing_is_due():
    InboxEventFactory(claimed=True)
    OutboxMessageFactory(scheduled=True)
    OutboxMessageFactory(dead=True)

    text = generate_latest(REGISTRY).decode()
    assert "django_idempotency_inbox_oldest_due_seconds 0.0" in text
    assert "django_idempotency_outbox_oldest_due_seconds 0.0" in text


@pytest.mark.parametrize(
    "failure", [OperationalError("the database is gone"), RuntimeError("not the database's")]
)
def test_a_failing_read_is_counted_and_the_rest_of_the_scrape_answers(failure, caplog):
    def fail(execute, sql, params, many, context):
        raise failure

    errors = sample("django_idempotency_scrape_errors_total")
    with connection.execute_wrapper(fail):
        text = generate_latest(REGISTRY).decode()

    families = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "django_idempotency_lease_renewals",
        "django_idempotency_overhead_seconds",
        "django_idempotency_scrape_errors",
    } <= families
    assert "django_idempotency_inbox_due_events" not in families
    # Counted in the very scrape that failed.
    assert f"django_idempotency_scrape_errors_total {errors + 1}" in text
    assert "the backlog could not be read" in caplog.text
    # The next scrape reads them again.
    assert sample("django_idempotency_inbox_due_events") == 0


def gone(cursor, pid) -> bool:
    cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
    return cursor.fetchone() is None


@pytest.mark.postgresql
@pytest.mark.skipif(BEHIND_PGBOUNCER, reason="a pooler hands the next query another connection")
def test_a_scrape_after_the_database_closed_the_connection_connects_again():
    errors = sample("django_idempotency_scrape_errors_total")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    killer = connection.copy()
    try:
        with killer.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
            # The backend is signalled: wait until it is gone.
            wait_for(lambda: gone(cursor, pid))
    finally:
        killer.close()

    assert "django_idempotency_inbox_due_events" not in generate_latest(REGISTRY).decode()
    assert sample("django_idempotency_scrape_errors_total") == errors + 1
    assert sample("django_idempotency_inbox_due_events") == 0


# --- prometheus-client's multiprocess mode ------------------------------------------------------

COUNT_IN_A_WORKER = """
import django

django.setup()
from django_idempotency import signals
from django_idempotency.models import IdempotencyKey

signals.lease_taken_over.send(sender=IdempotencyKey, key="k", scope="s", route="metrics/mp/")
"""


@pytest.mark.sqlite  # the same on every database: once
def test_under_multiprocess_mode_the_counters_add_up_and_the_gauges_are_served(tmp_path):
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    workers = [
        subprocess.Popen([sys.executable, "-c", COUNT_IN_A_WORKER], cwd=ROOT, env=env)
        for _ in range(2)
    ]
    assert [worker.wait(timeout=60) for worker in workers] == [0, 0]
    InboxEventFactory(dead=True)
    takeovers = {"route": "metrics/mp/"}

    # The registry that multiprocess mode serves has the processes' counters, not the gauges.
    bare = CollectorRegistry()
    MultiProcessCollector(bare, path=str(tmp_path))
    assert bare.get_sample_value("django_idempotency_lease_takeovers_total", takeovers) == 2
    assert bare.get_sample_value("django_idempotency_inbox_dead_events") is None
    # What serves /metrics in multiprocess mode, as the observability page shows it.
    registry = CollectorRegistry()
    register_database_gauges(registry)
    MultiProcessCollector(registry, path=str(tmp_path))

    assert registry.get_sample_value("django_idempotency_lease_takeovers_total", takeovers) == 2
    assert registry.get_sample_value("django_idempotency_inbox_dead_events") == 1
    assert registry.get_sample_value("django_idempotency_outbox_oldest_due_seconds") == 0
