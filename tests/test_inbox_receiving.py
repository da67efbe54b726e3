"""Recording a delivered inbox event once: dedupe on (source, event id), or on its payload."""

from __future__ import annotations

import threading

import pytest
from django.db import connection, transaction

from django_idempotency.core import canonical
from django_idempotency.inbox import receive
from django_idempotency.inbox.receiving import payload_hash
from django_idempotency.models import InboxEvent
from tests.conftest import in_memory_sqlite
from tests.inbox import deliver, refund_event

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_event_id_purged_long_ago_can_be_recorded_again():
    pk = receive("tests", "evt_1", "customer.created", {"id": "evt_1"}).event.pk
    InboxEvent.objects.filter(pk=pk).delete()

    assert receive("tests", "evt_1", "customer.created", {"id": "evt_1"}).created


def test_the_payload_hash_is_the_canonical_hash_also_beyond_what_rfc_8785_writes():
    # How canonical JSON treats key order and large integers is tested in test_canonical.
    for payload in ({"b": 2, "a": 1}, {"id": 2**64, "a": 1}):
        assert payload_hash(payload) == canonical.sha256(payload)


def test_a_recorded_event_reads_back_as_it_was_delivered():
    # The insert prepares its values itself (on PostgreSQL the JSON and the times as text):
    # what it stored is what the model's fields would have saved.
    from datetime import datetime, timedelta, timezone  # noqa: PLC0415

    payload = {
        "id": "evt_1",
        "text": 'quote " backslash \\ tab \t é ✓ 😀',
        "numbers": [0, -1, 2**63 - 1, 0.1, 1.5e-7, 2.5, True, False, None],
        "nested": {"b": [{}, []], "a": {"z": "y"}},
    }
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    headers = {"User-Agent": "Sender/1.0 ✓"}
    receipt = receive("tests", "evt_1", "tests.recorded", payload, headers=headers, now=at)
    for top_level in ("a string", 7, [1, "two"]):
        receive("tests", None, "plain", top_level, now=at)

    event = InboxEvent.objects.get(pk=receipt.event.pk)
    assert event.payload == payload
    assert event.headers == headers
    assert event.received_at == at
    assert event.payload_hash == payload_hash(payload)
    assert {(e.event_id, repr(e.payload)) for e in InboxEvent.objects.filter(source="tests")} >= {
        (f"sha256:{payload_hash(value)}", repr(value)) for value in ("a string", 7, [1, "two"])
    }
    assert not receive("tests", "evt_1", "tests.recorded", dict(reversed(payload.items()))).conflict


def test_a_correlation_id_that_a_request_could_not_carry_is_not_kept():
    # The event's handlers log the kept id and send it on: it has a request's bound (128
    # characters, no spaces), and what the middleware would ignore is dropped.
    deliver(
        refund_event("evt_long"), headers={"X-Correlation-ID": "x" * 129, "X-Request-ID": "lb-1"}
    )
    deliver(
        refund_event("evt_forged"), headers={"X-Correlation-ID": "a b", "X-Request-ID": "y" * 8000}
    )
    deliver(refund_event("evt_bound"), headers={"X-Correlation-ID": "z" * 128})
    # receive() called directly, with a message's headers spelled in lower case.
    receive(
        "tests",
        "msg_1",
        "customer.created",
        {},
        headers={"x-correlation-id": "a\nb", "x-request-id": "q-1", "x-tenant": "a b"},
    )

    kept = dict(InboxEvent.objects.values_list("event_id", "headers"))
    assert {"X-Request-ID": "lb-1"}.items() <= kept["evt_long"].items()
    assert "X-Correlation-ID" not in kept["evt_long"]
    assert not {"X-Correlation-ID", "X-Request-ID"} & kept["evt_forged"].keys()
    assert kept["evt_forged"]["Content-Type"] == "application/json"
    assert kept["evt_bound"]["X-Correlation-ID"] == "z" * 128
    # Other headers are the receiver's choice, kept as sent.
    assert kept["msg_1"] == {"x-request-id": "q-1", "x-tenant": "a b"}


@pytest.mark.server_db
def test_a_duplicate_that_waited_for_the_first_delivery_to_commit_is_seen_as_a_duplicate():
    inserted, release = threading.Event(), threading.Event()

    def first():
        try:
            with transaction.atomic():
                receive("tests", "evt_1", "customer.created", {"id": "evt_1"})
                inserted.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=first)
    holder.start()
    inserted.wait(10)
    # The duplicate's INSERT waits for the first transaction; its snapshot predates the commit.
    threading.Timer(0.3, release.set).start()
    receipt = receive("tests", "evt_1", "customer.created", {"id": "evt_1"})
    holder.join()

    assert not receipt.created
    assert not receipt.conflict
    assert InboxEvent.objects.count() == 1


def test_a_duplicate_delivery_writes_nothing_and_is_counted_with_its_time_a_moment_later():
    from datetime import timedelta  # noqa: PLC0415

    from django.db import connection  # noqa: PLC0415
    from django.test.utils import CaptureQueriesContext  # noqa: PLC0415
    from django.utils import timezone  # noqa: PLC0415

    from django_idempotency.inbox.receiving import delivery_counts  # noqa: PLC0415

    first = timezone.now()
    receive("tests", "evt_1", "customer.created", {"id": "evt_1"}, now=first)
    later = first + timedelta(minutes=5)
    with CaptureQueriesContext(connection) as captured:
        receipt = receive("tests", "evt_1", "customer.created", {"id": "evt_1"}, now=later)
    conflict = receive("tests", "evt_1", "customer.created", {"id": "evt_1", "x": 1}, now=later)

    assert not receipt.created
    assert conflict.conflict  # a delivery with another payload counts too
    if not in_memory_sqlite():  # where counts are written at once
        # The insert that found the event recorded, and on some databases a read of it: no
        # write that could wait for an attempt at processing the event.
        assert [q["sql"].split()[0] for q in captured] in (["WITH"], ["INSERT", "SELECT"])
        assert InboxEvent.objects.get().deliveries == 1
    else:
        assert InboxEvent.objects.get().deliveries == 3
    delivery_counts.flush()
    event = InboxEvent.objects.get()
    assert (event.deliveries, event.last_delivered_at) == (3, later)
    new = receive("tests", "evt_2", "customer.created", {"id": "evt_2"})
    new.event.refresh_from_db()
    assert (new.event.deliveries, new.event.last_delivered_at) == (1, None)
