"""Sending the package's own tasks by name (``django_idempotency.core.task_sending``).

Through the broker, or in process when Celery is eager.
"""

from __future__ import annotations

import pytest
from celery import current_app
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_idempotency import tasks
from django_idempotency.core import task_sending
from django_idempotency.inbox import receive
from django_idempotency.models import InboxEvent, OutboxMessage
from django_idempotency.outbox import publish
from tests.inbox import refund_event
from tests.libraries import without


def test_a_task_is_sent_by_its_name_and_a_broker_error_is_returned_not_raised(monkeypatch):
    sent = []
    monkeypatch.setattr(current_app, "send_task", lambda name, args: sent.append((name, args)))
    assert task_sending.enqueue("django_idempotency.process_inbox_event", 7) is None
    assert sent == [("django_idempotency.process_inbox_event", (7,))]

    refused = ConnectionRefusedError(111, "Connection refused")

    def unreachable(name, args):
        raise refused

    monkeypatch.setattr(current_app, "send_task", unreachable)
    assert task_sending.enqueue("django_idempotency.relay_outbox") is refused


def test_every_name_the_package_sends_is_one_of_its_tasks():
    names = {"django_idempotency.process_inbox_event", "django_idempotency.relay_outbox"}
    assert names <= {task.name for task in vars(tasks).values() if hasattr(task, "delay")}


@pytest.fixture
def eager(monkeypatch):
    def no_broker(*args, **kwargs):
        raise AssertionError("an eager app sent a task to the broker")

    monkeypatch.setattr(current_app, "send_task", no_broker)
    before = current_app.conf.task_always_eager
    current_app.conf.task_always_eager = True
    yield
    current_app.conf.task_always_eager = before


@pytest.mark.django_db(transaction=True)
@override_settings(IDEMPOTENCY={"INBOX_RUNNER": "celery", "OUTBOX_RUNNER": "celery"})
@pytest.mark.usefixtures("eager")
def test_an_eager_app_runs_the_tasks_in_process_as_their_delay_would():
    receipt = receive("tests", "evt_1", "refund.succeeded", refund_event())
    assert InboxEvent.objects.get(pk=receipt.event.pk).status == "processed"

    message = publish("tests.recorded", {})
    assert OutboxMessage.objects.get(pk=message.pk).status == "dispatched"


def test_sending_a_task_without_celery_names_the_extra():
    with without("celery"), pytest.raises(ImproperlyConfigured, match=r"\[celery\]"):
        task_sending.enqueue("django_idempotency.relay_outbox")
