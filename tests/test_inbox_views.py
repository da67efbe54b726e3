"""The webhook receiver over HTTP: verify, record once, process, answer."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from celery import current_app
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection
from django.test import Client, override_settings
from django.utils import timezone

from django_idempotency import signals
from django_idempotency.conf import DEFAULTS
from django_idempotency.inbox import WebhookReceiverView, views
from django_idempotency.inbox import processing as inbox_processing
from django_idempotency.models import InboxEvent
from django_idempotency.signing import GitHubSignature, StandardWebhooksSignature, StripeSignature
from tests.conftest import send_chunked
from tests.inbox import deliver, refund_event
from tests.testapp.models import Refund

pytestmark = pytest.mark.django_db(transaction=True)

MAX_JSON_DEPTH = DEFAULTS["MAX_JSON_DEPTH"]


def problem(response):
    assert response["Content-Type"] == "application/problem+json"
    return json.loads(response.content)


def test_a_signed_event_is_recorded_then_processed():
    payload = refund_event(amount=700)
    response = deliver(payload, headers={"User-Agent": "provider/1.0"})

    assert response.status_code == 200
    assert response.json() == {"status": "processed"}
    event = InboxEvent.objects.get()
    assert (event.source, event.event_id, event.event_type) == (
        "tests",
        payload["id"],
        "refund.succeeded",
    )
    assert event.payload == payload
    assert event.status == "processed"
    assert event.attempts == 1
    assert event.processed_at is not None
    assert event.next_attempt_at is None
    # The kept headers, and never the signature.
    assert event.headers == {"Content-Type": "application/json", "User-Agent": "provider/1.0"}
    assert list(Refund.objects.values_list("event_id", "amount")) == [(payload["id"], 700)]


def test_event_ids_that_differ_only_in_case_are_two_events():
    # Many senders' ids are case-sensitive (evt_1AbC, evt_1abc): MariaDB's columns compare bytes.
    for event_id in ("evt_1AbC", "evt_1abc"):
        assert deliver(refund_event(event_id, amount=5)).json() == {"status": "processed"}
    assert Refund.objects.count() == 2


def test_a_duplicate_answers_200_and_is_not_processed_again():
    payload = refund_event()
    deliver(payload)
    received, duplicates = [], []

    def on_received(**kwargs):
        received.append(kwargs)

    def on_duplicate(**kwargs):
        duplicates.append(kwargs)

    signals.inbox_event_received.connect(on_received)
    signals.inbox_event_duplicate.connect(on_duplicate)
    try:
        response = deliver(payload)
    finally:
        signals.inbox_event_received.disconnect(on_received)
        signals.inbox_event_duplicate.disconnect(on_duplicate)

    assert response.status_code == 200
    assert response.json() == {"status": "duplicate"}
    assert InboxEvent.objects.count() == 1
    assert Refund.objects.count() == 1
    assert received == []
    assert [(d["event"].event_id, d["conflict"]) for d in duplicates] == [(payload["id"], False)]


def test_the_same_id_with_another_payload_is_refused_and_the_first_kept():
    first = refund_event(amount=100)
    deliver(first)
    response = deliver({**first, "data": {"amount": 999}})

    assert response.status_code == 409
    assert problem(response)["code"] == "inbox.event_conflict"
    assert InboxEvent.objects.get().payload == first
    assert list(Refund.objects.values_list("amount", flat=True)) == [100]


def test_the_same_payload_with_its_keys_reordered_is_a_duplicate_not_a_conflict():
    payload = refund_event()
    deliver(payload)
    reordered = json.dumps(dict(reversed(payload.items()))).encode()

    assert deliver(reordered).json() == {"status": "duplicate"}


def test_an_event_without_an_id_is_deduplicated_by_its_payload_hash():
    payload = {"type": "refund.succeeded", "data": {"amount": 5}}

    assert deliver(payload).json() == {"status": "processed"}
    assert deliver(payload).json() == {"status": "duplicate"}
    assert deliver({**payload, "data": {"amount": 6}}).json() == {"status": "processed"}
    events = InboxEvent.objects.order_by("pk")
    assert [event.event_id for event in events] == [
        f"sha256:{event.payload_hash}" for event in events
    ]
    assert Refund.objects.count() == 2


def test_an_event_without_a_handler_is_recorded_and_marked_processed():
    response = deliver({"id": "evt_other", "type": "customer.created"})

    assert response.json() == {"status": "processed"}
    assert InboxEvent.objects.get().status == "processed"


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ("drop", "inbox.signature_missing"),
        ("wrong secret", "inbox.signature_invalid"),
        ("stale", "inbox.signature_expired"),
        ("tampered body", "inbox.signature_invalid"),
    ],
)
def test_a_bad_signature_is_refused_before_anything_is_written(change, code):
    body = json.dumps(refund_event()).encode()
    secrets = ["whsec_d3Jvbmc="] if change == "wrong secret" else settings.TEST_WEBHOOK_SECRETS
    timestamp = int(time.time()) - 3600 if change == "stale" else None
    headers = StandardWebhooksSignature(secrets).sign(body, msg_id="msg_1", timestamp=timestamp)
    if change == "drop":
        del headers["webhook-signature"]
    if change == "tampered body":
        body = body.replace(b"500", b"900")

    response = Client().post(
        "/webhooks/tests/", body, content_type="application/json", headers=headers
    )

    assert response.status_code == 400
    assert problem(response)["code"] == code
    assert not InboxEvent.objects.exists()
    assert not Refund.objects.exists()


def test_a_rotated_out_secret_still_in_the_list_is_accepted():
    old_secret = settings.TEST_WEBHOOK_SECRETS[1]

    response = deliver(refund_event(), signer=StandardWebhooksSignature([old_secret]))

    assert response.status_code == 200
    assert InboxEvent.objects.count() == 1


def test_stripe_style_signatures():
    payload = refund_event()

    response = deliver(
        payload,
        path="/webhooks/stripe/",
        signer=_Unkeyed(StripeSignature(["tests-only-old-secret"])),
    )

    assert response.json() == {"status": "processed"}
    assert InboxEvent.objects.get().source == "stripe"


def test_github_style_signatures_with_the_id_and_type_in_headers():
    body = json.dumps({"action": "opened", "number": 7}).encode()
    headers = {
        **GitHubSignature(["tests-only-old-secret"]).sign(body),
        "X-GitHub-Delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        "X-GitHub-Event": "pull_request",
    }
    for _ in range(2):
        response = Client().post(
            "/webhooks/github/", body, content_type="application/json", headers=headers
        )

    assert response.json() == {"status": "duplicate"}
    event = InboxEvent.objects.get()
    assert (event.source, event.event_id, event.event_type) == (
        "github",
        "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        "pull_request",
    )


def test_a_payload_over_the_limit_is_refused_with_413():
    response = deliver(refund_event(padding="x" * 100), path="/webhooks/small/")

    assert response.status_code == 413
    assert problem(response)["code"] == "inbox.payload_too_large"
    assert not InboxEvent.objects.exists()


@pytest.mark.parametrize(
    "body", [b"{not json", b"\xff\xfe", json.dumps({"id": "x" * 256, "type": "t"}).encode()]
)
def test_an_unreadable_payload_is_refused_with_400(body):
    response = deliver(body)

    assert response.status_code == 400
    assert problem(response)["code"] == "inbox.payload_invalid"
    assert not InboxEvent.objects.exists()


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
def test_a_payload_with_nan_or_an_infinity_is_refused_with_400_saying_why(number):
    response = deliver(
        b'{"id": "evt_nan", "type": "refund.succeeded", "data": {"amount": %s}}' % number.encode()
    )

    assert response.status_code == 400
    body = problem(response)
    assert body["code"] == "inbox.payload_invalid"
    assert "which is not a JSON number (RFC 8259)" in body["detail"]
    assert not InboxEvent.objects.exists()


def nested_event(depth: int) -> bytes:
    """A refund event whose JSON is ``depth`` levels deep, its two objects included."""
    arrays = b"[" * (depth - 2) + b"]" * (depth - 2)
    data = b'{"amount": 5, "nested": ' + arrays + b"}"
    return b'{"id": "evt_deep", "type": "refund.succeeded", "data": ' + data + b"}"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000])
def test_a_signed_payload_nested_too_deeply_is_refused_with_400_not_500(depth):
    response = deliver(nested_event(depth))

    assert response.status_code == 400
    body = problem(response)
    assert body["code"] == "inbox.payload_invalid"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in body["detail"]
    assert not InboxEvent.objects.exists()


def test_a_payload_at_the_depth_limit_is_recorded_and_processed():
    response = deliver(nested_event(MAX_JSON_DEPTH))

    assert response.status_code == 200
    assert InboxEvent.objects.get().event_id == "evt_deep"
    assert Refund.objects.get().amount == 5


def test_the_depth_limit_follows_the_setting(settings):
    settings.IDEMPOTENCY = {"MAX_JSON_DEPTH": 10}
    refused = deliver(nested_event(11))

    assert refused.status_code == 400
    assert "deeper than 10 levels" in problem(refused)["detail"]
    assert deliver(nested_event(10)).status_code == 200


def test_a_payload_of_the_projects_own_parser_is_held_to_the_depth_limit_too():
    from django.test import RequestFactory  # noqa: PLC0415

    class Receiver(WebhookReceiverView):
        source = "tests"  # its handlers are the test receiver's
        verifier = StandardWebhooksSignature(settings.TEST_WEBHOOK_SECRETS)

        def parse_payload(self, body):
            return json.loads(body)  # no depth check of its own

    def post(body):
        signed = Receiver.verifier.sign(body, msg_id="msg_own_parser")
        request = RequestFactory().post("/", body, content_type="application/json", headers=signed)
        return Receiver.as_view()(request)

    refused = post(nested_event(MAX_JSON_DEPTH + 1))

    assert refused.status_code == 400
    assert f"deeper than {MAX_JSON_DEPTH} levels" in problem(refused)["detail"]
    assert post(nested_event(MAX_JSON_DEPTH)).status_code == 200
    assert InboxEvent.objects.get().event_id == "evt_deep"


@pytest.mark.skipif(connection.vendor != "mysql", reason="only MariaDB stores less")
def test_a_payload_deeper_than_the_database_stores_is_refused_with_400_not_retried(settings):
    # MariaDB's JSON columns hold at most 31 levels: a setting that lets more through (W007)
    # still gets a 400, from the insert.
    settings.IDEMPOTENCY = {"MAX_JSON_DEPTH": 64}
    response = deliver(nested_event(MAX_JSON_DEPTH + 1))

    assert response.status_code == 400
    assert problem(response)["code"] == "inbox.payload_invalid"
    assert not InboxEvent.objects.exists()


def test_a_chunked_delivery_is_refused_as_unreadable_not_as_badly_signed():
    body = json.dumps(refund_event()).encode()
    signed = StandardWebhooksSignature(settings.TEST_WEBHOOK_SECRETS).sign(body, msg_id="msg_1")
    response = send_chunked(Client(), "POST", "/webhooks/tests/", body, headers=signed)

    assert response.status_code == 411
    assert problem(response)["code"] == "inbox.length_required"
    assert not InboxEvent.objects.exists()


def test_only_post_is_allowed():
    response = Client().get("/webhooks/tests/")

    assert response.status_code == 405
    assert response["Allow"] == "POST"
    assert problem(response)["code"] == "inbox.method_not_allowed"


def test_no_csrf_token_is_needed():
    response = deliver(refund_event(), client=Client(enforce_csrf_checks=True))

    assert response.status_code == 200


def test_a_failing_handler_answers_202_and_the_event_stays_recorded_for_its_retry():
    response = deliver(refund_event(fail="always"))

    assert response.status_code == 202
    assert response.json() == {"status": "failed"}
    event = InboxEvent.objects.get()
    assert event.status == "failed"
    assert event.attempts == 1
    assert event.next_attempt_at is not None
    assert event.last_error == "RuntimeError: the ledger is unavailable (attempt 1)"
    assert "Traceback" in event.last_traceback
    # A redelivery is a duplicate: the retry belongs to the inbox's schedule.
    assert deliver(event.payload).json() == {"status": "duplicate"}


@override_settings(IDEMPOTENCY={"INBOX_MAX_ATTEMPTS": 1})
def test_a_handler_that_fails_its_last_attempt_answers_202_dead():
    response = deliver(refund_event(fail="always"))

    assert (response.status_code, response.json()) == (202, {"status": "dead"})
    assert InboxEvent.objects.get().status == "dead"


def test_the_event_is_recorded_under_atomic_requests_even_when_its_handler_fails(monkeypatch):
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)

    response = deliver(refund_event(fail="always"))

    assert response.status_code == 202
    assert InboxEvent.objects.get().status == "failed"


@override_settings(IDEMPOTENCY={"INBOX_RUNNER": "celery"})
def test_with_celery_and_no_broker_the_event_is_recorded_for_the_periodic_run(monkeypatch, caplog):
    def unreachable(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(current_app, "send_task", unreachable)
    response = deliver(refund_event())

    assert response.json() == {"status": "queued"}
    assert InboxEvent.objects.get().status == "received"
    assert "could not hand inbox event" in caplog.text


def test_a_database_failure_answers_503(monkeypatch):
    def down(*args, **kwargs):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(views, "receive", down)
    response = deliver(refund_event())

    assert response.status_code == 503
    assert problem(response)["code"] == "idempotency.unavailable"


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"verifier": StripeSignature(["s"])}, "needs a source"),
        ({"verifier": StripeSignature(["s"]), "source": "x" * 101}, "needs a source"),
        ({"source": "x"}, "needs a verifier"),
    ],
)
def test_a_misconfigured_receiver_fails_when_the_urlconf_loads(attributes, message):
    view = type("Receiver", (WebhookReceiverView,), attributes)

    with pytest.raises(ImproperlyConfigured, match=message):
        view.as_view()


def test_a_receiver_may_build_its_verifier_at_request_time():
    class Receiver(WebhookReceiverView):
        source = "x"

        def get_verifier(self):
            return StripeSignature(["s"])

    assert callable(Receiver.as_view())


class _Unkeyed:
    """Adapts a signer whose ``sign()`` takes no message id."""

    def __init__(self, signer):
        self.signer = signer

    def sign(self, body, msg_id):
        return self.signer.sign(body)


def test_a_database_failure_while_processing_inline_keeps_the_event_for_the_periodic_run(
    monkeypatch,
):
    def down(pk):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(inbox_processing, "process", down)
    response = deliver(refund_event())

    assert (response.status_code, response.json()) == (202, {"status": "failed"})
    assert InboxEvent.objects.get().status == "received"


def test_a_payload_the_database_cannot_store_is_refused_with_400_not_retried_forever():
    payload = {"id": "evt_nul_text", "type": "customer.created", "data": {"note": "a\u0000b"}}
    response = deliver(payload)

    if connection.vendor == "postgresql":
        assert response.status_code == 400
        assert problem(response)["code"] == "inbox.payload_invalid"
        assert not InboxEvent.objects.exists()
    else:
        assert response.json() == {"status": "processed"}  # SQLite stores NUL characters


def test_a_payload_that_is_not_an_object_is_deduplicated_by_its_hash():
    assert deliver(b"[1, 2, 3]").json() == {"status": "processed"}
    assert deliver(b"[1, 2, 3]").json() == {"status": "duplicate"}

    event = InboxEvent.objects.get()
    assert (event.event_id, event.event_type) == (f"sha256:{event.payload_hash}", "")


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=100)
def test_a_body_over_djangos_own_limit_is_refused_with_413():
    response = deliver(refund_event(padding="x" * 200))

    assert response.status_code == 413
    assert not InboxEvent.objects.exists()


def test_an_unreadable_content_length_is_refused_with_400():
    response = Client().post(
        "/webhooks/tests/", b"{}", content_type="application/json", CONTENT_LENGTH="many"
    )

    assert response.status_code == 400
    assert problem(response)["code"] == "inbox.payload_invalid"


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "\\ud800", "type": "refund.succeeded", "data": {}}',
        b'{"id": "evt_\\u0000", "type": "refund.succeeded", "data": {}}',
        b'{"id": "evt_1", "type": "refund.\\udfff", "data": {}}',
    ],
    ids=["lone-surrogate-id", "nul-id", "lone-surrogate-type"],
)
def test_an_event_id_or_type_no_column_can_hold_is_refused_with_400(body):
    response = deliver(body)
    assert response.status_code == 400
    assert problem(response)["code"] == "inbox.payload_invalid"
    assert not InboxEvent.objects.exists()


def test_a_recorded_event_whose_processing_loses_the_database_answers_202():
    payload = refund_event(lose_database=True)

    response = deliver(payload)

    # Recorded: the rest is the inbox's job. A 5xx would only make the sender deliver a
    # duplicate again, and disable the endpoint after a few.
    assert response.status_code == 202
    assert response.json() == {"status": "failed"}
    event = InboxEvent.objects.get()
    assert event.attempts == 1
    assert event.processed_at is None
    assert event.next_attempt_at is not None
    assert not Refund.objects.exists()
    redelivery = deliver(payload)
    assert (redelivery.status_code, redelivery.json()) == (200, {"status": "duplicate"})

    later = timezone.now() + timedelta(hours=1)
    assert inbox_processing.dispatch_due(now=later) == 1
    assert inbox_processing.dispatch_due(now=later) == 0
    event.refresh_from_db()
    assert (event.status, event.attempts) == ("processed", 2)
    assert list(Refund.objects.values_list("event_id", flat=True)) == [payload["id"]]
