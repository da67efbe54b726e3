"""django_idempotency.testing: the keyed client, assert_idempotent and the off switch."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import SimpleTestCase, override_settings
from rest_framework.test import APIClient

from django_idempotency import signals
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyKey, InboxEvent
from django_idempotency.operations.checks import check_settings
from django_idempotency.testing import IdempotentAPIClient, assert_idempotent, idempotency_disabled
from tests.conftest import basic_auth
from tests.inbox import deliver, refund_event
from tests.testapp.models import LedgerEntry, Payment, Refund

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(alice):
    client = IdempotentAPIClient()
    client.force_authenticate(alice)
    return client


@pytest.fixture
def plain_api(alice):
    client = APIClient()
    client.force_authenticate(alice)
    return client


def sent_key(response, header="Idempotency-Key"):
    return response.wsgi_request.headers.get(header)


def effects():
    return Payment.objects.count(), LedgerEntry.objects.count()


class TestIdempotentAPIClient:
    def test_each_unsafe_call_gets_a_fresh_key(self, api):
        first = api.post("/payments/", {"amount": 10}, format="json")
        second = api.post("/payments/", {"amount": 10}, format="json")

        assert first.status_code == second.status_code == 201
        assert first["Idempotency-Status"] == second["Idempotency-Status"] == "stored"
        assert sent_key(first) != sent_key(second)
        assert uuid.UUID(sent_key(second)).version == 4
        assert api.last_key == sent_key(second)
        assert effects() == (2, 2)

    def test_retry_sends_the_same_request_with_the_same_key(self, api):
        first = api.post("/payments/?source=test", {"amount": 10, "currency": "USD"}, format="json")
        retried = api.retry()

        # A replay: the path, the query string and the body match the first request's.
        assert retried["Idempotency-Status"] == "replayed"
        assert retried.status_code == 201
        assert retried.content == first.content
        assert sent_key(retried) == sent_key(first) == api.last_key
        assert retried.wsgi_request.META["QUERY_STRING"] == "source=test"
        assert effects() == (1, 1)

    def test_retry_sends_a_multipart_body_byte_for_byte(self, api):
        first = api.post("/payments/", {"amount": 5})  # DRF's default test format
        retried = api.retry()

        assert first.wsgi_request.content_type == "multipart/form-data"
        assert retried["Idempotency-Status"] == "replayed"
        for name in ("CONTENT_TYPE", "CONTENT_LENGTH"):  # the boundary and the size
            assert retried.wsgi_request.META[name] == first.wsgi_request.META[name]
        assert effects() == (1, 1)

    def test_put_patch_delete_and_generic_get_keys(self, api, alice):
        payment = Payment.objects.create(owner=alice, amount=1)
        detail = f"/api/viewset-payments/{payment.pk}/"

        responses = [
            api.patch(detail, {"amount": 2}, format="json"),
            api.put("/put/", {"amount": 3}, format="json"),
            api.generic("POST", "/payments/", json.dumps({"amount": 4}), "application/json"),
            api.delete(detail),
        ]

        assert [response.status_code for response in responses] == [200, 200, 201, 204]
        assert {response["Idempotency-Status"] for response in responses} == {"stored"}
        keys = [sent_key(response) for response in responses]
        assert len(set(keys)) == 4
        assert api.last_key == keys[-1]
        assert api.retry()["Idempotency-Status"] == "replayed"  # the DELETE

    def test_safe_methods_get_no_key_and_leave_the_last_request_alone(self, api):
        api.post("/payments/", {"amount": 10}, format="json")
        key = api.last_key

        for response in (
            api.get("/payments/"),
            api.options("/payments/"),
            api.head("/payments/"),
            api.generic("GET", "/payments/"),
        ):
            assert response.status_code == 200
            assert sent_key(response) is None
        assert api.last_key == key
        retried = api.retry()
        assert retried["Idempotency-Status"] == "replayed"
        assert sent_key(retried) == key

    def test_a_key_given_by_the_caller_is_sent_as_is(self, api):
        given = api.post(
            "/payments/", {"amount": 1}, format="json", headers={"idempotency-key": "k1"}
        )
        assert sent_key(given) == api.last_key == "k1"

        meta = api.post("/payments/", {"amount": 1}, format="json", HTTP_IDEMPOTENCY_KEY="k2")
        assert sent_key(meta) == api.last_key == "k2"
        assert api.retry()["Idempotency-Status"] == "replayed"
        assert effects() == (2, 2)

    @override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
    def test_the_header_follows_the_setting(self, api):
        response = api.post("/payments/", {"amount": 1}, format="json")

        assert sent_key(response) is None
        assert sent_key(response, "X-Request-Key") == api.last_key
        assert response["Idempotency-Status"] == "stored"
        assert api.retry()["Idempotency-Status"] == "replayed"

    def test_other_headers_and_credentials_are_kept(self, alice):
        client = IdempotentAPIClient()
        client.credentials(HTTP_AUTHORIZATION=basic_auth(alice))
        first = client.post("/headers/", {"amount": 1}, format="json", headers={"X-Tenant": "blue"})
        retried = client.retry()

        assert first.status_code == 201
        assert retried["Idempotency-Status"] == "replayed"  # X-Tenant is in the fingerprint
        assert retried.wsgi_request.headers["X-Tenant"] == "blue"
        assert Payment.objects.get().owner == alice

    def test_retry_runs_the_view_again_after_an_answer_that_was_not_stored(self, api):
        first = api.post("/payments/", {"amount": 1}, format="json", headers={"X-Status": "503"})
        retried = api.retry()

        assert first.status_code == retried.status_code == 503
        assert "Idempotency-Status" not in retried
        assert sent_key(retried) == sent_key(first)
        assert effects() == (0, 0)  # each attempt was rolled back

    def test_retry_needs_an_unsafe_request_first(self, api):
        api.get("/payments/")
        with pytest.raises(RuntimeError, match=r"retry\(\) needs an earlier POST"):
            api.retry()


class TestAssertIdempotent:
    def test_passes_for_an_idempotent_drf_view(self, plain_api):
        first, second = assert_idempotent(
            plain_api, "POST", "/payments/", {"amount": 10}, format="json", effect=effects
        )

        assert first.status_code == second.status_code == 201
        assert first["Idempotency-Status"] == "stored"
        assert second["Idempotency-Status"] == "replayed"
        assert second.json() == first.json()
        assert sent_key(first) == sent_key(second)
        assert effects() == (1, 1)

    def test_passes_with_the_keyed_client_which_sends_the_assertions_key(self, api):
        first, second = assert_idempotent(api, "post", "/payments/", {"amount": 1}, format="json")
        assert api.last_key == sent_key(first) == sent_key(second)

    def test_a_key_given_by_the_caller_is_used(self, plain_api):
        first, _ = assert_idempotent(
            plain_api,
            "POST",
            "/payments/",
            {"amount": 1},
            format="json",
            headers={"Idempotency-Key": "mine"},
        )
        assert sent_key(first) == "mine"

    def test_passes_for_a_plain_view_with_djangos_client(self, client):
        first, second = assert_idempotent(
            client,
            "POST",
            "/plain/",
            {"amount": 3},
            content_type="application/json",
            effect=Payment.objects.count,
        )
        assert first.status_code == second.status_code == 201
        assert Payment.objects.count() == 1

    def test_a_delete_without_data(self, client, alice):
        Payment.objects.create(amount=1)
        Payment.objects.create(amount=2)
        first, _ = assert_idempotent(
            client,
            "DELETE",
            "/payments/",
            headers={"Authorization": basic_auth(alice)},
            effect=Payment.objects.count,
        )
        assert first.json() == {"deleted": 2}
        assert first.wsgi_request.body == b""

    def test_a_business_error_is_idempotent_too(self, plain_api):
        first, _ = assert_idempotent(
            plain_api,
            "POST",
            "/payments/",
            {"amount": 1},
            format="json",
            headers={"X-Status": "402"},
            effect=effects,
        )
        assert first.status_code == 402

    def test_a_rejected_request_is_not_kept_so_it_is_not_replayed(self, plain_api):
        with pytest.raises(AssertionError, match="invalid-request statuses are not"):
            assert_idempotent(
                plain_api, "POST", "/payments/", {"amount": "ten"}, format="json", effect=effects
            )

    def test_a_streaming_answer_is_compared_and_still_readable(self, client):
        first, second = assert_idempotent(
            client, "POST", "/streaming/", effect=Payment.objects.count
        )

        assert first.streaming
        assert b"".join(first.streaming_content) == b"chunk-1,chunk-2"
        assert second.content == b"chunk-1,chunk-2"

    def test_fails_for_a_view_that_is_not_idempotent(self, api):
        with pytest.raises(AssertionError) as failure:
            assert_idempotent(
                api,
                "POST",
                "/not-idempotent/",
                {"amount": 10},
                format="json",
                effect=Payment.objects.count,
            )

        message = str(failure.value)
        lines = message.splitlines()
        assert re.fullmatch(
            r"POST /not-idempotent/ with Idempotency-Key: [0-9a-f-]{36} is not idempotent:",
            lines[0],
        )
        assert lines[1] == (
            "- the retry was not replayed (no Idempotency-Status header): the first response was "
            "201 with no Idempotency-Status header either, so no key was handled; is the view "
            "idempotent (IdempotentMixin or @idempotent), with POST among its methods?"
        )
        assert re.fullmatch(
            r"""- body: b'\{"id":\d+\}' the first time, b'\{"id":\d+\}' on the retry""", lines[2]
        )
        assert lines[3] == "- effect: 0 before the first request, 1 after it, 2 after the retry"
        assert len(lines) == 4  # the statuses are the same

    def test_fails_when_the_first_answer_was_not_stored(self, plain_api):
        with pytest.raises(AssertionError) as failure:
            assert_idempotent(
                plain_api,
                "POST",
                "/payments/",
                {"amount": 1},
                format="json",
                headers={"X-Status": "429"},
                effect=effects,
            )

        lines = str(failure.value).splitlines()
        assert lines[1:] == [
            "- the retry was not replayed (no Idempotency-Status header): the first response was "
            "429, which is never stored (5xx, retryable and invalid-request statuses are not), so "
            "the retry ran the view again"
        ]

    def test_names_each_part_that_differs(self):
        class CannedClient:
            def __init__(self, *responses):
                self.responses = list(responses)

            def post(self, path, data=None, **extra):
                return self.responses.pop(0)

            put = patch = delete = post

        first = HttpResponse(b"a", status=201)
        first["Idempotency-Status"] = "stored"
        second = HttpResponse(b"b" * 300, status=200)
        second["Idempotency-Status"] = "stored"
        counter = iter(range(3))

        with pytest.raises(AssertionError) as failure:
            assert_idempotent(
                CannedClient(first, second),
                "PATCH",
                "/things/1/",
                {"name": "x"},
                effect=lambda: next(counter),
                headers={"Idempotency-Key": "k"},
            )

        assert str(failure.value).splitlines() == [
            "PATCH /things/1/ with Idempotency-Key: k is not idempotent:",
            "- the retry was not replayed (Idempotency-Status: stored): the first response was "
            "201 with Idempotency-Status: stored",
            "- status: 201 the first time, 200 on the retry",
            f"- body: b'a' the first time, {b'b' * 200!r}… (300 bytes) on the retry",
            "- effect: 0 before the first request, 1 after it, 2 after the retry",
        ]

    def test_refuses_a_safe_method(self, client):
        with pytest.raises(ValueError, match="not GET"):
            assert_idempotent(client, "GET", "/payments/")

    def test_fails_at_once_while_idempotency_is_disabled(self, plain_api):
        with idempotency_disabled(), pytest.raises(AssertionError, match=r"'ENABLED'\] is False"):
            assert_idempotent(plain_api, "POST", "/payments/", {"amount": 1}, format="json")
        assert effects() == (0, 0)


class TestIdempotencyDisabled:
    def test_drf_views_run_as_if_they_were_not_idempotent(self, api, plain_api):
        with idempotency_disabled():
            without_key = plain_api.post("/payments/", {"amount": 1}, format="json")
            with_key = api.post("/payments/", {"amount": 1}, format="json")
            retried = api.retry()

        assert without_key.status_code == with_key.status_code == retried.status_code == 201
        for response in (without_key, with_key, retried):
            assert "Idempotency-Status" not in response
        assert effects() == (3, 3)
        assert IdempotencyKey.objects.count() == 0

        # And back on afterwards.
        assert plain_api.post("/payments/", {"amount": 1}, format="json").status_code == 400

    def test_plain_views_too_and_no_signal_is_sent(self, client):
        sent = []

        def receiver(signal, **kwargs):
            sent.append(signal)

        for signal in (signals.key_stored, signals.key_replayed, signals.key_missing):
            signal.connect(receiver)
        try:
            with idempotency_disabled():
                for headers in ({}, {"Idempotency-Key": "k"}, {"Idempotency-Key": "k"}):
                    response = client.post(
                        "/plain/", {"amount": 1}, content_type="application/json", headers=headers
                    )
                    assert response.status_code == 201
                    assert "Idempotency-Status" not in response
        finally:
            for signal in (signals.key_stored, signals.key_replayed, signals.key_missing):
                signal.disconnect(receiver)

        assert sent == []
        assert Payment.objects.count() == 3

    def test_the_other_settings_are_kept_and_restored(self):
        with override_settings(IDEMPOTENCY={"HEADER": "X-Key"}):
            with idempotency_disabled():
                assert idempotency_settings.user_settings == {"HEADER": "X-Key", "ENABLED": False}
            assert idempotency_settings.user_settings == {"HEADER": "X-Key"}
            assert idempotency_settings.ENABLED
        assert idempotency_settings.HEADER == "Idempotency-Key"

    def test_it_reads_the_settings_when_entered_not_when_made(self):
        switch = idempotency_disabled()
        with override_settings(IDEMPOTENCY={"HEADER": "X-Key"}), switch:
            assert idempotency_settings.HEADER == "X-Key"
            assert not idempotency_settings.ENABLED

    @idempotency_disabled()
    def test_as_a_function_decorator(self, api):
        assert not idempotency_settings.ENABLED
        assert "Idempotency-Status" not in api.post("/payments/", {"amount": 1}, format="json")

    def test_the_setting_itself_works_with_override_settings(self, plain_api):
        with override_settings(IDEMPOTENCY={"ENABLED": False}):
            response = plain_api.post("/payments/", {"amount": 1}, format="json")
        assert response.status_code == 201
        assert "Idempotency-Status" not in response

    @pytest.mark.django_db(transaction=True)
    def test_a_live_server_thread_sees_it(self, live_server):
        def post():
            return httpx.post(f"{live_server.url}/anonymous/", json={"amount": 1}, timeout=10)

        assert post().status_code == 400  # idempotency.key_missing
        with idempotency_disabled():
            assert post().status_code == 201

    @pytest.mark.django_db(transaction=True)
    def test_the_webhook_inbox_still_records_each_event_once(self):
        payload = refund_event(amount=300)
        with idempotency_disabled():
            assert deliver(payload).status_code == 200
            assert deliver(payload).status_code == 200
        assert InboxEvent.objects.count() == 1
        assert list(Refund.objects.values_list("amount", flat=True)) == [300]


@idempotency_disabled()
class TestAsATestCaseDecorator(SimpleTestCase):
    def test_each_test_runs_with_idempotency_disabled(self):
        assert not idempotency_settings.ENABLED


class TestTheEnabledSetting:
    def test_defaults_to_true(self):
        assert idempotency_settings.ENABLED is True

    @pytest.mark.parametrize("value", ["no", 0, None])
    def test_a_value_that_is_not_a_bool_is_an_error(self, value):
        with override_settings(IDEMPOTENCY={"ENABLED": value}):
            assert [message.id for message in check_settings()] == ["django_idempotency.E027"]
            with pytest.raises(ImproperlyConfigured, match=r"IDEMPOTENCY\['ENABLED'\].*E027"):
                idempotency_settings.ENABLED  # noqa: B018

    def test_false_passes_the_checks(self):
        with override_settings(IDEMPOTENCY={"ENABLED": False}):
            assert check_settings() == []
