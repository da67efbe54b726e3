"""The state changes that the inbox logs, one record each, with from_state and to_state."""

from __future__ import annotations

import logging

import pytest
from django.db import transaction
from django.test import override_settings

from django_idempotency.inbox.processing import mark_dead, process, reprocess
from django_idempotency.models import InboxEvent
from tests.factories import InboxEventFactory
from tests.inbox import deliver, refund_event

pytestmark = pytest.mark.django_db(transaction=True)


def changes(caplog):
    return [
        (r.idempotency_event_id, r.from_state, r.to_state, getattr(r, "correlation_id", None))
        for r in caplog.records
        if hasattr(r, "from_state") and r.name == "django_idempotency.inbox"
    ]


def test_each_state_change_of_an_event_is_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="django_idempotency.inbox")
    with override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 2}):
        deliver(refund_event("evt_a", fail="always"), headers={"X-Correlation-ID": "c-1"})
        event = InboxEvent.objects.get()
        process(event.pk, now=event.next_attempt_at)
    InboxEvent.objects.update(payload=refund_event("evt_a"))
    reprocess(InboxEvent.objects.all())  # processed again at once

    assert changes(caplog) == [
        ("evt_a", "received", "processing", "c-1"),
        ("evt_a", "processing", "failed", "c-1"),
        ("evt_a", "failed", "processing", "c-1"),
        ("evt_a", "processing", "dead", "c-1"),
        ("evt_a", "dead", "received", "c-1"),
        ("evt_a", "received", "processing", "c-1"),
        ("evt_a", "processing", "processed", "c-1"),
    ]


def test_an_event_marked_dead_by_a_person_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.inbox")
    failed = InboxEventFactory(event_id="evt_f", status=InboxEvent.Status.FAILED, attempts=1)
    InboxEventFactory(event_id="evt_done", processed=True)

    assert mark_dead(InboxEvent.objects.all()) == [failed.pk]
    assert changes(caplog) == [("evt_f", "failed", "dead", None)]


def test_an_event_whose_worker_died_every_time_is_logged_dead(caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.inbox")
    event = InboxEventFactory(event_id="evt_w", claimed=True)

    with override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 1}):
        assert process(event.pk, now=event.next_attempt_at) == "dead"
    assert changes(caplog) == [("evt_w", "processing", "dead", None)]


def test_the_claim_is_logged_only_at_debug(caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.inbox")
    deliver(refund_event("evt_i"))
    assert changes(caplog) == [("evt_i", "processing", "processed", None)]


@pytest.mark.parametrize("action", [mark_dead, reprocess])
def test_a_persons_action_is_logged_only_once_it_commits(caplog, action):
    # Under ATOMIC_REQUESTS the admin's action runs in the request's transaction, which may
    # still roll back.
    caplog.set_level(logging.INFO, logger="django_idempotency.inbox")
    InboxEventFactory(event_id="evt_f", failed=True)

    with transaction.atomic():
        assert action(InboxEvent.objects.all()) != []
        logged_before_the_commit = changes(caplog)
        transaction.set_rollback(True)

    assert logged_before_the_commit == []
    assert changes(caplog) == []
    assert InboxEvent.objects.get().status == "failed"
