"""The correlation id and the fields of the library's log records, seen from outside."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from django.db import transaction
from django.http import HttpResponse, JsonResponse
from django.test import RequestFactory, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.core.correlation import (
    CorrelationIdFilter,
    CorrelationIdMiddleware,
    bind,
    from_headers,
    get_correlation_id,
)
from django_idempotency.core.outcomes import _problem_code
from django_idempotency.decorators import idempotent
from django_idempotency.inbox.processing import process
from django_idempotency.models import InboxEvent, OutboxMessage
from django_idempotency.outbox import publish
from django_idempotency.outbox import relaying as outbox_relay
from tests.factories import InboxEventFactory
from tests.test_outbox import server, to_inbox  # noqa: F401 - fixtures
from tests.testapp import urls as testapp_urls

WITH_MIDDLEWARE = override_settings(
    MIDDLEWARE=[
        "django_idempotency.core.correlation.CorrelationIdMiddleware",
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ]
)


def decisions(caplog):
    return [
        r
        for r in caplog.records
        if hasattr(r, "idempotency_outcome") and r.name == "django_idempotency"
    ]


# The correlation id of a request.


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"X-Correlation-ID": "req-1", "X-Request-ID": "other"}, "req-1"),
        ({"X-Request-ID": "lb-7f3a"}, "lb-7f3a"),
        ({"x-correlation-id": "lower-case"}, "lower-case"),
        ({"X-Correlation-ID": "bad id\nINFO forged line", "X-Request-ID": "ok"}, "ok"),
        ({"X-Correlation-ID": "x" * 129}, None),
        ({}, None),
        (None, None),
    ],
)
def test_the_id_is_read_from_the_headers_when_acceptable(headers, expected):
    assert from_headers(headers) == expected


def test_the_middleware_binds_the_requests_id_and_sends_it_back():
    seen = []

    def view(request):
        seen.append(get_correlation_id())
        return HttpResponse()

    middleware = CorrelationIdMiddleware(view)
    response = middleware(RequestFactory().get("/", headers={"X-Request-ID": "from-the-lb"}))
    made_up = middleware(RequestFactory().get("/"))

    assert seen[0] == response["X-Correlation-ID"] == "from-the-lb"
    assert seen[1] == made_up["X-Correlation-ID"]
    assert len(made_up["X-Correlation-ID"]) == 32
    assert get_correlation_id() is None  # unbound once the request is over


def test_the_middleware_works_in_an_async_stack():
    async def view(request):
        return HttpResponse(get_correlation_id())

    middleware = CorrelationIdMiddleware(view)
    request = RequestFactory().get("/", headers={"X-Correlation-ID": "async-1"})
    response = asyncio.run(middleware(request))

    assert response.content == b"async-1"
    assert response["X-Correlation-ID"] == "async-1"


def test_the_filter_stamps_any_record_with_the_current_id():
    record = logging.LogRecord("app", logging.INFO, __file__, 1, "hello", (), None)
    with bind("abc"):
        CorrelationIdFilter().filter(record)
    assert record.correlation_id == "abc"
    unbound = logging.LogRecord("app", logging.INFO, __file__, 1, "hello", (), None)
    CorrelationIdFilter().filter(unbound)
    assert unbound.correlation_id is None


# Decision records.


@WITH_MIDDLEWARE
def test_a_decision_record_carries_the_id_fingerprint_and_state_change(client_alice, key, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    client_alice.send(
        "POST", "/payments/", {"amount": 1}, key=key, headers={"X-Correlation-ID": "corr-1"}
    )
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

    stored, replayed = decisions(caplog)
    assert stored.correlation_id == "corr-1"
    assert (stored.from_state, stored.to_state) == ("in_progress", "succeeded")
    assert len(stored.idempotency_fingerprint) == 12
    int(stored.idempotency_fingerprint, 16)
    assert stored.idempotency_problem is None
    # The same request, so the same fingerprint; a replay changes no state.
    assert replayed.idempotency_fingerprint == stored.idempotency_fingerprint
    assert (replayed.from_state, replayed.to_state) == (None, None)
    assert replayed.correlation_id not in (None, "corr-1")  # made up by the middleware


def test_a_refused_request_logs_its_problem_code(client_alice, key, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    client_alice.send("POST", "/payments/", {"amount": 2}, key=key)
    client_alice.send("POST", "/payments/", {"amount": 2})
    client_alice.send("POST", "/payments/", {"amount": 2}, key="no spaces allowed")

    records = decisions(caplog)
    assert [(r.idempotency_outcome, r.idempotency_problem) for r in records] == [
        ("stored", None),
        ("mismatch", "idempotency.payload_mismatch"),
        ("missing", "idempotency.key_missing"),
        ("invalid", "idempotency.key_invalid"),
    ]
    # A mismatch is another request: another fingerprint.
    assert records[1].idempotency_fingerprint != records[0].idempotency_fingerprint
    # The fingerprint is never computed without a valid key.
    assert records[2].idempotency_fingerprint is None


def test_a_response_that_is_not_stored_releases_the_key(client_alice, key, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers={"X-Status": "503"})

    (record,) = decisions(caplog)
    assert record.idempotency_outcome == "not_stored"
    assert (record.from_state, record.to_state) == ("in_progress", "released")


def test_without_the_middleware_the_requests_header_still_reaches_the_record(
    client_alice, key, caplog
):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    client_alice.send(
        "POST", "/payments/", {"amount": 1}, key=key, headers={"X-Request-ID": "lb-1"}
    )
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)

    assert [r.correlation_id for r in decisions(caplog)] == ["lb-1", None]


def test_decision_logging_costs_nothing_when_info_is_off(client_alice, key, caplog):
    caplog.set_level(logging.WARNING, logger="django_idempotency")
    client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
    assert decisions(caplog) == []


# Outbox messages.


@pytest.mark.django_db(transaction=True)
def test_a_message_published_in_a_request_keeps_its_correlation_id(monkeypatch):
    monkeypatch.setattr(outbox_relay, "trigger", lambda: None)  # not sent here
    with bind("corr-2"), transaction.atomic():
        inside = publish("tests.recorded", {"a": 1})
        chosen = publish("tests.recorded", {"a": 2}, headers={"x-correlation-id": "given"})
    outside = publish("tests.recorded", {"a": 3})

    stored = dict(OutboxMessage.objects.values_list("pk", "headers"))
    assert stored[inside.pk] == {"X-Correlation-ID": "corr-2"}
    assert stored[chosen.pk] == {"x-correlation-id": "given"}
    assert stored[outside.pk] == {}


# From a request, through the outbox and a webhook, to the inbox of another service.


@csrf_exempt
@idempotent
def checkout(request):
    logging.getLogger("tests.checkout").info("checking out")
    publish("payment.captured", {"amount": json.loads(request.body)["amount"]})
    return JsonResponse({}, status=201)


urlpatterns = [path("checkout/", checkout), *testapp_urls.urlpatterns]


@pytest.fixture
def stamped(caplog):
    """Every record, the project's own included, stamped with the current correlation id."""
    caplog.set_level(logging.INFO)
    stamp = CorrelationIdFilter()
    caplog.handler.addFilter(stamp)
    yield caplog
    caplog.handler.removeFilter(stamp)


def ours(caplog):
    return [r for r in caplog.records if r.name.startswith(("django_idempotency", "tests."))]


@pytest.mark.django_db(transaction=True)
@WITH_MIDDLEWARE
@override_settings(ROOT_URLCONF=__name__)
@pytest.mark.usefixtures("to_inbox")
def test_one_id_from_the_request_to_the_inbox_handler(client_alice, key, stamped):
    # The receiving service runs without the middleware: the stored header carries the id.
    response = client_alice.send(
        "POST", "/checkout/", {"amount": 700}, key=key, headers={"X-Correlation-ID": "corr-e2e"}
    )

    assert response.status_code == 201
    assert response["X-Correlation-ID"] == "corr-e2e"
    message = OutboxMessage.objects.get()
    assert message.status == "dispatched"
    assert message.headers == {"X-Correlation-ID": "corr-e2e"}
    event = InboxEvent.objects.get()
    assert event.headers["X-Correlation-ID"] == "corr-e2e"
    assert event.status == "processed"
    messages = {r.getMessage().split(" ")[0]: r for r in ours(stamped)}
    # The view, the decision, the relay, the inbox's receipt, its handler and its outcome.
    assert {
        "checking",
        "idempotency",
        "dispatched",
        "relayed",
        "recorded",
        "refunding",
        "processed",
    } <= set(messages)
    assert {r.getMessage(): r.correlation_id for r in ours(stamped)} == {
        r.getMessage(): "corr-e2e" for r in ours(stamped)
    }
    assert (messages["dispatched"].from_state, messages["dispatched"].to_state) == (
        "pending",
        "dispatched",
    )
    assert (messages["processed"].from_state, messages["processed"].to_state) == (
        "processing",
        "processed",
    )


@pytest.mark.django_db(transaction=True)
def test_an_event_processed_later_runs_its_handler_with_its_id(stamped):
    event = InboxEventFactory(
        source="outbox",
        event_type="payment.captured",
        payload={"data": {"amount": 5}},
        headers={"x-request-id": "later-1"},
    )
    with bind("the-worker's-own"):
        assert process(event.pk) == "processed"

    handler = [r for r in stamped.records if r.name == "tests.handlers"]
    assert [r.correlation_id for r in handler] == ["later-1"]
    (done,) = [r for r in stamped.records if r.getMessage().startswith("processed inbox event")]
    assert done.correlation_id == "later-1"
    assert get_correlation_id() is None


def test_a_streamed_answer_is_not_read_for_a_problem_code(client_alice, key, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    response = client_alice.send("POST", "/streaming/", {}, key=key)

    assert b"".join(response.streaming_content) == b"chunk-1,chunk-2"
    (record,) = decisions(caplog)
    assert record.idempotency_problem is None


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"code": "validation.invalid"}', "validation.invalid"),
        (b'{"code": 42}', None),
        (b"[1, 2]", None),
        (b"not json", None),
        (b'{"code": "x", "pad": "' + b"x" * 20_000 + b'"}', None),
    ],
)
def test_a_views_own_problem_code_is_read_when_it_is_a_small_json_object(body, code):
    response = HttpResponse(body, content_type="application/problem+json", status=400)
    assert _problem_code(response) == code
    assert _problem_code(HttpResponse(body, content_type="application/json")) is None


def test_the_middleware_leaves_a_views_own_correlation_header_alone():
    def view(request):
        response = HttpResponse()
        response["X-Correlation-ID"] = "the-view's"
        return response

    response = CorrelationIdMiddleware(view)(RequestFactory().get("/"))
    assert response["X-Correlation-ID"] == "the-view's"
