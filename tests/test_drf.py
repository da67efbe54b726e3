"""The HTTP contract (DESIGN §2) through the DRF mixin, on SQLite and PostgreSQL."""

from __future__ import annotations

import ast
import http.client
import inspect
import json
import socket
import textwrap

import pytest
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.test import override_settings
from django.urls import path
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory
from rest_framework.views import APIView

from django_idempotency.conf import DEEPEST_JSON, DEFAULTS
from django_idempotency.core.store import replay_counts
from django_idempotency.drf import ConditionalMixin, IdempotentMixin, JSONParser
from django_idempotency.models import IdempotencyKey
from tests.conftest import ApiClient, basic_auth, send_chunked
from tests.testapp.conditional import (
    COMPOSITIONS,
    ComposedDocument,
    ComposedDocumentSet,
    CountedUpdates,
    ProjectMixin,
    composed,
)
from tests.testapp.models import Document, LedgerEntry, Payment

pytestmark = pytest.mark.django_db

MAX_JSON_DEPTH = DEFAULTS["MAX_JSON_DEPTH"]


def problem(response) -> dict:
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert set(body) == {"type", "title", "status", "detail", "code"}
    assert body["status"] == response.status_code
    assert body["type"].endswith(body["code"])
    return body


def effects() -> tuple[int, int, int]:
    return Payment.objects.count(), LedgerEntry.objects.count(), IdempotencyKey.objects.count()


class TestFirstRequestAndReplay:
    def test_first_request_runs_and_is_stored(self, client_alice, key):
        response = client_alice.send("POST", "/payments/", {"amount": 1000}, key=key)

        assert response.status_code == 201
        assert response["Idempotency-Status"] == "stored"
        assert "Idempotent-Replayed" not in response
        assert effects() == (1, 1, 1)
        row = IdempotencyKey.objects.get()
        assert row.state == IdempotencyKey.State.SUCCEEDED
        assert row.key == key
        assert row.method == "POST"
        assert row.route == "payments/"
        assert row.response_status == 201
        assert bytes(row.response_body) == response.content
        assert len(row.fingerprint) == 64

    def test_replay_returns_the_stored_answer_without_running_the_view(self, client_alice, key):
        first = client_alice.send("POST", "/payments/", {"amount": 1000}, key=key)
        second = client_alice.send("POST", "/payments/", {"amount": 1000}, key=key)

        assert second.status_code == first.status_code == 201
        assert second.content == first.content
        # Headers the view set (DRF's finalize_response adds Vary and Allow to every answer).
        for header in ("Content-Type", "Location", "ETag", "X-Request-Trace"):
            assert second[header] == first[header]
        assert second["Idempotency-Status"] == "replayed"
        assert second["Idempotent-Replayed"] == "true"
        assert effects() == (1, 1, 1)

    def test_replay_never_carries_the_first_responses_cookies(self, client_alice, key):
        first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
        assert "flavour" in first.cookies
        assert first["Set-Cookie"] == "session=first-response-only"
        second = ApiClient(client_alice.user).send("POST", "/payments/", {"amount": 5}, key=key)
        assert "flavour" not in second.cookies
        assert "Set-Cookie" not in second
        stored = dict(IdempotencyKey.objects.get().response_headers)
        assert "Set-Cookie" not in stored
        assert stored["X-Request-Trace"] == "view-set"

    def test_replays_are_counted(self, client_alice, key):
        for _ in range(3):
            client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
        replay_counts.flush()
        row = IdempotencyKey.objects.get()
        assert row.replay_count == 2
        assert row.last_replayed_at is not None

    def test_json_key_order_and_whitespace_do_not_matter(self, client_alice, key):
        client_alice.send("POST", "/payments/", '{"amount": 7, "currency": "USD"}', key=key)
        second = client_alice.send("POST", "/payments/", '{ "currency":"USD","amount":7 }', key=key)
        assert second["Idempotency-Status"] == "replayed"
        assert effects() == (1, 1, 1)


class TestMismatch:
    def test_same_key_with_a_different_body_is_422_and_changes_nothing(self, client_alice, key):
        first = client_alice.send("POST", "/payments/", {"amount": 1000}, key=key)
        second = client_alice.send("POST", "/payments/", {"amount": 2000}, key=key)

        assert second.status_code == 422
        assert problem(second)["code"] == "idempotency.payload_mismatch"
        assert effects() == (1, 1, 1)
        row = IdempotencyKey.objects.get()
        assert bytes(row.response_body) == first.content
        assert row.replay_count == 0

    def test_a_different_query_string_is_a_different_request(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        second = client_alice.send("POST", "/payments/?currency=USD", {"amount": 1}, key=key)
        assert second.status_code == 422

    def test_named_fingerprint_headers_take_part(self, client_alice, key):
        client_alice.send("POST", "/headers/", {"amount": 1}, key=key, headers={"X-Tenant": "a"})
        same = client_alice.send(
            "POST", "/headers/", {"amount": 1}, key=key, headers={"X-Tenant": "a"}
        )
        other = client_alice.send(
            "POST", "/headers/", {"amount": 1}, key=key, headers={"X-Tenant": "b"}
        )
        assert same["Idempotency-Status"] == "replayed"
        assert other.status_code == 422


class TestKeyHeader:
    def test_missing_key_is_400(self, client_alice):
        response = client_alice.send("POST", "/payments/", {"amount": 1})
        assert response.status_code == 400
        assert problem(response)["code"] == "idempotency.key_missing"
        assert effects() == (0, 0, 0)

    def test_optional_key_runs_without_dedupe(self, client_alice):
        client_alice.send("POST", "/optional/", {"amount": 1})
        client_alice.send("POST", "/optional/", {"amount": 1})
        assert effects() == (2, 2, 0)

    @override_settings(IDEMPOTENCY={"KEY_REQUIRED": False})
    def test_the_setting_makes_keys_optional_everywhere(self, client_alice):
        response = client_alice.send("POST", "/payments/", {"amount": 1})
        assert response.status_code == 201
        assert "Idempotency-Status" not in response

    @pytest.mark.parametrize(
        "bad_key",
        [
            "",
            "a" * 256,
            "has space",
            "tab\there",
            "caf\u00e9",
            "\x7f",
            '"unterminated',
            '"bad \\x escape"',
            '""',
            '"' + "a" * 256 + '"',
        ],
        ids=[
            "empty",
            "too-long",
            "space",
            "tab",
            "non-ascii",
            "del",
            "unterminated-quote",
            "bad-escape",
            "empty-quoted",
            "too-long-quoted",
        ],
    )
    def test_malformed_keys_are_400_never_500(self, client_alice, bad_key):
        response = client_alice.send("POST", "/payments/", {"amount": 1}, key=bad_key)
        assert response.status_code == 400
        assert problem(response)["code"] == "idempotency.key_invalid"
        assert effects() == (0, 0, 0)

    def test_a_key_of_255_visible_characters_is_accepted(self, client_alice):
        key = "~" * 255
        assert client_alice.send("POST", "/payments/", {"amount": 1}, key=key).status_code == 201

    def test_quoted_and_bare_forms_name_the_same_key(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        quoted = client_alice.send("POST", "/payments/", {"amount": 1}, key=f'"{key}"')
        assert quoted["Idempotency-Status"] == "replayed"
        assert IdempotencyKey.objects.get().key == key

    @pytest.mark.parametrize("joined", ["{k},{k}", "{k},other", '"{k}", "{k}"', '"{k}",{k}'])
    def test_a_list_of_keys_is_400_not_a_new_key(self, client_alice, key, joined):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        response = client_alice.send("POST", "/payments/", {"amount": 1}, key=joined.format(k=key))
        assert response.status_code == 400
        body = problem(response)
        assert body["code"] == "idempotency.key_invalid"
        assert "more than one key" in body["detail"]
        assert effects() == (1, 1, 1)

    def test_a_quoted_key_may_contain_a_comma(self, client_alice, key):
        response = client_alice.send("POST", "/payments/", {"amount": 1}, key=f'"{key},2"')
        assert response.status_code == 201
        assert IdempotencyKey.objects.get().key == f"{key},2"

    @pytest.mark.django_db(transaction=True)
    def test_a_header_sent_twice_over_http_is_refused(self, alice, key, live_server):
        def post(*keys):
            connection = http.client.HTTPConnection(
                live_server.thread.host, live_server.thread.port
            )
            body = json.dumps({"amount": 1}).encode()
            connection.putrequest("POST", "/payments/")
            connection.putheader("Authorization", basic_auth(alice))
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(body)))
            for each in keys:
                connection.putheader("Idempotency-Key", each)
            connection.endheaders(body)
            response = connection.getresponse()
            answer = response.status, json.loads(response.read())
            connection.close()
            return answer

        assert post(key)[0] == 201
        # The server joins the two lines into "key,key": that is not a new key.
        status, body = post(key, key)
        assert (status, body["code"]) == (400, "idempotency.key_invalid")
        status, body = post(key, "another")
        assert (status, body["code"]) == (400, "idempotency.key_invalid")
        assert effects() == (1, 1, 1)

    @override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
    def test_the_header_name_is_a_setting(self, client_alice, key):
        response = client_alice.send(
            "POST", "/payments/", {"amount": 1}, headers={"X-Request-Key": key}
        )
        assert response["Idempotency-Status"] == "stored"

    @pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS"])
    def test_safe_methods_ignore_the_header(self, client_alice, key, method):
        response = client_alice.send(method, "/payments/", key=key)
        assert response.status_code == 200
        assert "Idempotency-Status" not in response
        assert IdempotencyKey.objects.count() == 0


class TestWhatIsStored:
    def test_a_rejected_request_is_not_kept_and_the_corrected_retry_runs(self, client_alice, key):
        rejected = client_alice.send("POST", "/payments/", {"amount": -1}, key=key)
        assert rejected.status_code == 400
        assert "Idempotency-Status" not in rejected
        assert effects() == (0, 0, 0)

        corrected = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
        assert corrected.status_code == 201
        assert corrected["Idempotency-Status"] == "stored"
        assert effects() == (1, 1, 1)

    def test_a_validation_error_after_a_write_rolls_the_write_back(self, client_alice, key):
        fail = {"X-Fail": "validation"}
        for _ in range(2):  # not replayed: the view runs again
            response = client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers=fail)
            assert response.status_code == 400
            assert "Idempotency-Status" not in response
        assert effects() == (0, 0, 0)

    @pytest.mark.parametrize("status", [402, 403, 404, 410])
    def test_a_business_4xx_is_stored_and_replayed(self, client_alice, key, status):
        outcome = {"X-Status": str(status)}
        first = client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers=outcome)
        second = client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers=outcome)
        assert first.status_code == second.status_code == status
        assert first["Idempotency-Status"] == "stored"
        assert second["Idempotency-Status"] == "replayed"
        assert second.content == first.content
        assert effects() == (1, 1, 1)

    @override_settings(IDEMPOTENCY={"INVALID_REQUEST_STATUS_CODES": []})
    def test_invalid_request_statuses_are_a_setting(self, client_alice, key):
        first = client_alice.send("POST", "/payments/", {"amount": -1}, key=key)
        second = client_alice.send("POST", "/payments/", {"amount": -1}, key=key)
        assert first["Idempotency-Status"] == "stored"
        assert second["Idempotency-Status"] == "replayed"
        assert second.content == first.content

    @pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503])
    def test_retryable_statuses_roll_back_and_release_the_key(self, client_alice, key, status):
        first = client_alice.send(
            "POST", "/payments/", {"amount": 1}, key=key, headers={"X-Status": str(status)}
        )
        assert first.status_code == status
        assert "Idempotency-Status" not in first
        assert effects() == (0, 0, 0)

        retry = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert retry.status_code == 201
        assert retry["Idempotency-Status"] == "stored"
        assert effects() == (1, 1, 1)

    @override_settings(IDEMPOTENCY={"RETRYABLE_STATUS_CODES": [409, 429]})
    def test_retryable_statuses_are_a_setting(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers={"X-Status": "425"})
        assert effects() == (1, 1, 1)

    def test_an_exception_after_the_write_keeps_nothing_and_the_retry_runs_once(
        self, client_alice, key
    ):
        with pytest.raises(RuntimeError, match="boom"):
            client_alice.send(
                "POST", "/payments/", {"amount": 1}, key=key, headers={"X-Fail": "exception"}
            )
        assert effects() == (0, 0, 0)

        retry = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        replay = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert retry["Idempotency-Status"] == "stored"
        assert replay["Idempotency-Status"] == "replayed"
        assert effects() == (1, 1, 1)


class TestScope:
    def test_alice_and_bob_never_share_a_key(self, client_alice, client_bob, key):
        alice = client_alice.send("POST", "/payments/", {"amount": 100}, key=key)
        bob = client_bob.send("POST", "/payments/", {"amount": 200}, key=key)

        assert alice["Idempotency-Status"] == bob["Idempotency-Status"] == "stored"
        assert json.loads(bob.content)["amount"] == 200
        assert json.loads(alice.content)["id"] != json.loads(bob.content)["id"]
        assert effects() == (2, 2, 2)

    def test_the_same_key_on_another_route_is_another_operation(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        other = client_alice.send("POST", "/payments/other-route/", {"amount": 1}, key=key)
        assert other["Idempotency-Status"] == "stored"
        assert Payment.objects.count() == 2

    def test_the_scope_holds_the_route_pattern_and_the_fingerprint_the_path(
        self, client_alice, key
    ):
        client_alice.send("POST", "/tenant/a/payments/", {"amount": 1}, key=key)
        same = client_alice.send("POST", "/tenant/a/payments/", {"amount": 1}, key=key)
        other_resource = client_alice.send("POST", "/tenant/b/payments/", {"amount": 1}, key=key)

        assert same["Idempotency-Status"] == "replayed"
        # The same key sent for another resource under the route is a different request.
        assert other_resource.status_code == 422
        row = IdempotencyKey.objects.get()
        assert row.route == "tenant/<str:tenant>/payments/"
        assert row.scope == f"auth.user:{client_alice.user.pk} POST tenant/<str:tenant>/payments/"

    def test_a_key_reused_on_another_object_is_a_mismatch(self, client_alice, key):
        first, second = Payment.objects.create(amount=10), Payment.objects.create(amount=20)
        client_alice.send("POST", f"/api/viewset-payments/{first.pk}/refund/", {}, key=key)
        other = client_alice.send("POST", f"/api/viewset-payments/{second.pk}/refund/", {}, key=key)
        assert other.status_code == 422
        assert LedgerEntry.objects.filter(payment=second).count() == 0

    def test_the_same_key_with_another_method_is_another_operation(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        delete = client_alice.send("DELETE", "/payments/", key=key)
        assert delete["Idempotency-Status"] == "stored"
        assert IdempotencyKey.objects.count() == 2

    def test_a_replay_still_needs_authentication(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        anonymous = ApiClient().send("POST", "/payments/", {"amount": 1}, key=key)
        assert anonymous.status_code in (401, 403)
        assert "Idempotency-Status" not in anonymous

    def test_a_replay_passes_throttling(self, client_alice, key):
        cache.clear()
        answers = [
            client_alice.send("POST", "/throttled/", {"amount": 1}, key=key).status_code
            for _ in range(3)
        ]
        cache.clear()
        assert answers == [201, 201, 429]
        assert Payment.objects.count() == 1

    def test_anonymous_requests_share_one_principal_by_default(self, key):
        ApiClient().send("POST", "/anonymous/", {"amount": 1}, key=key)
        second = ApiClient().send("POST", "/anonymous/", {"amount": 1}, key=key)
        assert second["Idempotency-Status"] == "replayed"
        assert IdempotencyKey.objects.get().scope.startswith("anonymous ")

    @override_settings(IDEMPOTENCY={"ANONYMOUS": "reject"})
    def test_anonymous_requests_can_be_rejected(self, key):
        response = ApiClient().send("POST", "/anonymous/", {"amount": 1}, key=key)
        assert response.status_code == 403
        assert problem(response)["code"] == "idempotency.anonymous_rejected"
        assert effects() == (0, 0, 0)


class TestMethods:
    def test_put_is_not_idempotent_unless_asked(self, client_alice, key):
        payment = Payment.objects.create(amount=1)
        url = f"/api/viewset-payments/{payment.pk}/"
        response = client_alice.send("PUT", url, {"amount": 2, "currency": "EUR"}, key=key)
        assert response.status_code == 200
        assert "Idempotency-Status" not in response
        assert IdempotencyKey.objects.count() == 0

    def test_put_opt_in(self, client_alice, key):
        client_alice.send("PUT", "/put/", {"amount": 3}, key=key)
        second = client_alice.send("PUT", "/put/", {"amount": 3}, key=key)
        assert second["Idempotency-Status"] == "replayed"
        assert Payment.objects.count() == 1

    def test_patch_and_delete_are_idempotent(self, client_alice, key):
        payment = Payment.objects.create(amount=1)
        url = f"/api/viewset-payments/{payment.pk}/"
        client_alice.send("PATCH", url, {"amount": 9}, key=key)
        second = client_alice.send("PATCH", url, {"amount": 9}, key=key)
        assert second["Idempotency-Status"] == "replayed"
        gone = client_alice.send("DELETE", url, key=key)
        again = client_alice.send("DELETE", url, key=key)
        assert gone.status_code == again.status_code == 204
        assert again["Idempotency-Status"] == "replayed"


class TestViewSet:
    def test_create_and_an_action_are_idempotent(self, client_alice, key):
        created = client_alice.send("POST", "/api/viewset-payments/", {"amount": 40}, key=key)
        again = client_alice.send("POST", "/api/viewset-payments/", {"amount": 40}, key=key)
        assert again.content == created.content
        payment_id = json.loads(created.content)["id"]

        url = f"/api/viewset-payments/{payment_id}/refund/"
        refund = client_alice.send("POST", url, {}, key="refund-1")
        replay = client_alice.send("POST", url, {}, key="refund-1")
        assert refund.status_code == replay.status_code == 201
        assert replay["Idempotency-Status"] == "replayed"
        assert replay.content == refund.content
        assert LedgerEntry.objects.filter(amount=-40).count() == 1
        assert IdempotencyKey.objects.get(key="refund-1").route.endswith("refund/$")


class TestAtomicRequests:
    @pytest.fixture(autouse=True)
    def atomic_requests(self, monkeypatch):
        from django.db import connection  # noqa: PLC0415

        monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)

    def test_a_business_api_error_after_a_write_is_stored_and_the_write_undone(
        self, client_alice, key
    ):
        # The refund view's "already refunded" is a 400 too: kept here, as a business outcome.
        fail = {"X-Fail": "validation"}
        with override_settings(IDEMPOTENCY={"INVALID_REQUEST_STATUS_CODES": [422]}):
            first = client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers=fail)
            second = client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers=fail)

        assert first.status_code == second.status_code == 400
        assert first["Idempotency-Status"] == "stored"
        assert second["Idempotency-Status"] == "replayed"
        assert second.content == first.content
        assert effects() == (0, 0, 1)

    def test_a_rejected_request_is_not_kept(self, client_alice, key):
        fail = {"X-Fail": "validation"}
        first = client_alice.send("POST", "/payments/", {"amount": 1}, key=key, headers=fail)
        assert first.status_code == 400
        assert "Idempotency-Status" not in first
        assert effects() == (0, 0, 0)

    def test_success_is_stored_as_usual(self, client_alice, key):
        client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        second = client_alice.send("POST", "/payments/", {"amount": 1}, key=key)
        assert second["Idempotency-Status"] == "replayed"
        assert effects() == (1, 1, 1)

    def test_an_exception_still_rolls_everything_back(self, client_alice, key):
        with pytest.raises(RuntimeError):
            client_alice.send(
                "POST", "/payments/", {"amount": 1}, key=key, headers={"X-Fail": "exception"}
            )
        assert effects() == (0, 0, 0)


class TestPerViewOptions:
    def test_a_plain_function_as_scope_function(self, client_alice, client_bob, key):
        client_alice.send("POST", "/per-tenant/", {"amount": 1}, key=key, headers={"X-Tenant": "t"})
        bob = client_bob.send(
            "POST", "/per-tenant/", {"amount": 1}, key=key, headers={"X-Tenant": "t"}
        )
        # Scoped by tenant only: Bob's request is Alice's, replayed.
        assert bob["Idempotency-Status"] == "replayed"
        assert IdempotencyKey.objects.get().scope == "tenant:t"

    def test_get_idempotency_scope_decides_the_scope(self, client_alice, client_bob, key):
        url = "/accounts/acme/payments/"
        client_alice.send("POST", url, {"amount": 1}, key=key)
        bob = client_bob.send("POST", url, {"amount": 1}, key=key)
        other_account = client_bob.send("POST", "/accounts/other/payments/", {"amount": 1}, key=key)
        assert bob["Idempotency-Status"] == "replayed"
        assert other_account["Idempotency-Status"] == "stored"
        scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
        assert scopes == {"account:acme", "account:other"}

    @override_settings(ROOT_URLCONF="tests.testapp.misconfigured_urls")
    def test_a_scope_function_that_cannot_be_imported_names_the_view(self, client_alice, key):
        with pytest.raises(ImproperlyConfigured, match="UnimportableScopePaymentView"):
            client_alice.send("POST", "/unimportable-scope/", {"amount": 1}, key=key)
        assert effects() == (0, 0, 0)

    @override_settings(ROOT_URLCONF="tests.testapp.misconfigured_urls")
    def test_a_string_where_a_list_belongs_is_an_error(self, client_alice, key):
        with pytest.raises(ImproperlyConfigured, match="methods option must be a non-empty list"):
            client_alice.send("POST", "/misconfigured/", {"amount": 1}, key=key)
        assert effects() == (0, 0, 0)


def serving(view):
    """A URLconf that serves ``view`` at ``documents/<pk>/``."""
    actions = {"get": "retrieve", "patch": "partial_update"}
    served = view.as_view(actions) if issubclass(view, ComposedDocumentSet) else view.as_view()

    class URLConf:
        urlpatterns = [path("documents/<int:pk>/", served)]

    return URLConf


@pytest.mark.parametrize(
    "mode",
    # Lease mode commits the key's claim before the view runs: outside the test's transaction.
    ["atomic", pytest.param("lease", marks=pytest.mark.django_db(transaction=True))],
)
@pytest.mark.parametrize(
    "bases", COMPOSITIONS, ids=lambda bases: ",".join(base.__name__ for base in bases)
)
@pytest.mark.parametrize("generic", [ComposedDocument, ComposedDocumentSet])
def test_the_mixins_compose_in_any_order(alice, generic, bases, mode):
    """IdempotentMixin, ConditionalMixin and a project's mixin over initial() and
    finalize_response(), in each order: the same answers, and the view runs once per key."""
    view = composed(bases, mode, generic)
    CountedUpdates.runs.clear()
    document = Document.objects.create(title="draft")
    client = ApiClient(alice)

    def patch(title, key):
        url = f"/documents/{document.pk}/"
        return client.send("PATCH", url, {"title": title}, key=key, headers={"If-Match": '"1"'})

    with override_settings(ROOT_URLCONF=serving(view)):
        answers = [
            patch("final", "edit-1"),
            patch("final", "edit-1"),
            patch("other", "edit-2"),  # another key: its If-Match is stale by now
            patch("other", "edit-2"),
            patch("changed", "edit-1"),
        ]

    assert [(a.status_code, a.get("Idempotency-Status"), a.get("ETag")) for a in answers] == [
        (200, "stored", '"2"'),
        (200, "replayed", '"2"'),
        (412, "stored", '"2"'),
        (412, "replayed", '"2"'),
        (422, None, None),
    ]
    assert answers[1].content == answers[0].content
    assert problem(answers[3])["code"] == "precondition.failed"
    assert answers[3].content == answers[2].content
    assert problem(answers[4])["code"] == "idempotency.payload_mismatch"
    # The replays and the mismatch never reached the view.
    assert CountedUpdates.runs == [view.__name__] * 2
    document.refresh_from_db()
    assert (document.title, document.version) == ("final", 2)
    assert IdempotencyKey.objects.count() == 2
    stamps = {answer.get("X-Project") for answer in answers}
    assert stamps == ({"seen"} if ProjectMixin in bases else {None})


class Dispatched:
    """A project's own mixin over dispatch()."""

    def dispatch(self, request, *args, **kwargs):
        response = super().dispatch(request, *args, **kwargs)
        response["X-Dispatched"] = "yes"
        return response


def test_a_dispatch_before_the_mixins_goes_around_them(alice):
    view = composed((Dispatched, ConditionalMixin, IdempotentMixin), "atomic")
    CountedUpdates.runs.clear()
    document = Document.objects.create(title="draft")
    client = ApiClient(alice)
    url = f"/documents/{document.pk}/"

    with override_settings(ROOT_URLCONF=serving(view)):
        first, again = (
            client.send("PATCH", url, {"title": "final"}, key="edit", headers={"If-Match": '"1"'})
            for _ in range(2)
        )

    assert (first.status_code, first["Idempotency-Status"], first["X-Dispatched"]) == (
        200,
        "stored",
        "yes",
    )
    assert (again.status_code, again["Idempotency-Status"], again["X-Dispatched"]) == (
        200,
        "replayed",
        "yes",
    )
    assert len(CountedUpdates.runs) == 1


@pytest.mark.parametrize("mixins", [(IdempotentMixin,), (ConditionalMixin,)])
def test_a_dispatch_after_the_mixins_is_refused_as_it_would_not_run(mixins):
    # The mixins dispatch the request themselves: DRF has no hook around the handler alone.
    with pytest.raises(ImproperlyConfigured, match=r"Dispatched.dispatch\(\) would not run"):
        composed((*mixins, Dispatched), "atomic")


DRF_DISPATCH = """\
self.args = args
self.kwargs = kwargs
request = self.initialize_request(request, *args, **kwargs)
self.request = request
self.headers = self.default_response_headers
try:
    self.initial(request, *args, **kwargs)
    if request.method.lower() in self.http_method_names:
        handler = getattr(self, request.method.lower(), self.http_method_not_allowed)
    else:
        handler = self.http_method_not_allowed
    response = handler(request, *args, **kwargs)
except Exception as exc:
    response = self.handle_exception(exc)
self.response = self.finalize_response(request, response, *args, **kwargs)
return self.response"""


def test_drfs_dispatch_takes_the_steps_the_mixins_take():
    # The mixins' dispatch() is this one, with the handler's call opened up: when a release of
    # DRF changes it, bring theirs in step.
    function = ast.parse(textwrap.dedent(inspect.getsource(APIView.dispatch))).body[0]
    docstring = function.body[0] if ast.get_docstring(function) else None
    assert "\n".join(ast.unparse(step) for step in function.body if step is not docstring) == (
        DRF_DISPATCH
    )


def test_the_decorator_refuses_a_drf_view():
    from django_idempotency.decorators import idempotent  # noqa: PLC0415
    from tests.testapp.views import PaymentView  # noqa: PLC0415

    with pytest.raises(ImproperlyConfigured, match="IdempotentMixin"):
        idempotent(PaymentView.as_view())


def test_a_permission_that_reads_the_body_first_does_not_break_the_fingerprint(client_alice, key):
    first = client_alice.send("POST", "/text-note/", "hello", key=key, content_type="text/plain")
    again = client_alice.send("POST", "/text-note/", "hello", key=key, content_type="text/plain")
    other = client_alice.send("POST", "/text-note/", "bye", key=key, content_type="text/plain")
    assert first.status_code == 201
    assert json.loads(first.content) == {"note": "hello"}
    assert again["Idempotency-Status"] == "replayed"
    assert other.status_code == 422
    assert Payment.objects.count() == 1


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/payments/"),
        ("PATCH", "/api/viewset-payments/1/"),
        ("POST", "/plain/"),
    ],
)
@pytest.mark.parametrize(
    "content_type",
    ["multipart/form-data", "multipart/form-data; boundary=", "multipart/form-data; boundary=ü"],
)
def test_a_malformed_multipart_body_with_a_key_is_a_400_not_a_500(
    client_alice, key, method, path, content_type
):
    response = client_alice.send(method, path, b"amount=5", content_type=content_type, key=key)

    assert response.status_code == 400
    body = json.loads(response.content)
    assert body["code"] == "idempotency.body_invalid"
    assert "ü" not in body["detail"]  # nothing of the request is echoed
    assert not IdempotencyKey.objects.exists()
    assert not Payment.objects.exists()


@pytest.mark.parametrize("path", ["/payments/", "/plain/"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000])
def test_a_json_body_nested_too_deeply_with_a_key_is_a_400_not_a_500(
    client_alice, key, path, depth
):
    body = b'{"amount": ' + b"[" * depth + b"]" * depth + b"}"
    response = client_alice.send("POST", path, body, key=key)

    assert response.status_code == 400
    body = problem(response)
    assert body["code"] == "idempotency.body_invalid"
    assert f"deeper than {MAX_JSON_DEPTH} levels" in body["detail"]
    assert effects() == (0, 0, 0)


def nested_metadata(depth: int) -> str:
    """A payment whose body is ``depth`` levels deep: itself, its metadata and arrays."""
    return '{"amount": 5, "metadata": {"a": ' + "[" * (depth - 2) + "]" * (depth - 2) + "}}"


@pytest.mark.parametrize("path", ["/payments/", "/plain/"])
def test_json_deeper_than_mariadb_stores_with_a_key_is_a_400_on_every_database(
    client_alice, key, path
):
    # MariaDB's JSON check refuses 32 levels: such a body reached its insert, and the
    # IntegrityError was a 500. The default depth limit is what every database stores.
    response = client_alice.send("POST", path, nested_metadata(40), key=key)

    assert response.status_code == 400
    body = problem(response)
    assert body["code"] == "idempotency.body_invalid"
    assert body["detail"] == f"The JSON body is nested deeper than {MAX_JSON_DEPTH} levels."
    assert effects() == (0, 0, 0)
    retry = client_alice.send("POST", path, nested_metadata(MAX_JSON_DEPTH), key=key)
    assert retry.status_code == 201
    assert effects() == (1, 1, 1)


@pytest.mark.skipif(connection.vendor == "mysql", reason="MariaDB stores 31 levels at most")
@pytest.mark.parametrize("path", ["/payments/", "/plain/"])
def test_json_as_deep_as_the_setting_allows_is_stored_and_replayed(
    client_alice, key, path, settings
):
    settings.IDEMPOTENCY = {"MAX_JSON_DEPTH": DEEPEST_JSON}
    body = nested_metadata(DEEPEST_JSON)
    first = client_alice.send("POST", path, body, key=key)
    replay = client_alice.send("POST", path, body, key=key)

    assert (first.status_code, replay["Idempotency-Status"]) == (201, "replayed")
    assert replay.content == first.content
    assert effects() == (1, 1, 1)
    refused = client_alice.send("POST", path, nested_metadata(DEEPEST_JSON + 1), key=f"{key}-2")
    assert problem(refused)["code"] == "idempotency.body_invalid"


@pytest.mark.parametrize("path", ["/payments/", "/plain/"])
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_nan_or_an_infinity_with_a_key_is_a_400_and_the_corrected_retry_runs(
    client_alice, key, path, number
):
    # The plain view reads the body with json.loads, which takes them; the database would not.
    body = f'{{"amount": 5, "metadata": {{"rate": {number}}}}}'
    response = client_alice.send("POST", path, body, key=key)

    assert response.status_code == 400
    assert problem(response)["code"] == "idempotency.body_invalid"
    assert effects() == (0, 0, 0)
    retry = client_alice.send("POST", path, '{"amount": 5, "metadata": {"rate": 1.5}}', key=key)
    assert retry.status_code == 201
    assert Payment.objects.get().metadata == {"rate": 1.5}


class TestJSONParser:
    """The JSON parser the library ships for DRF: a depth limit, so deep JSON is a 400 too
    without a key."""

    class Echo(APIView):
        authentication_classes = ()
        permission_classes = ()
        parser_classes = (JSONParser,)

        def post(self, request):
            return Response({"data": request.data})

    def post(self, body: bytes):
        request = APIRequestFactory().post("/", body, content_type="application/json")
        return self.Echo.as_view()(request)

    @pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000])
    def test_json_nested_too_deeply_is_a_parse_error(self, depth):
        response = self.post(b"[" * depth + b"]" * depth)
        assert response.status_code == 400
        assert f"deeper than {MAX_JSON_DEPTH} levels" in response.data["detail"]

    def test_json_at_the_limit_is_parsed(self):
        response = self.post(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
        assert response.status_code == 200

    def test_the_limit_follows_the_setting(self, settings):
        settings.IDEMPOTENCY = {"MAX_JSON_DEPTH": 10}
        assert self.post(b"[" * 10 + b"]" * 10).status_code == 200
        response = self.post(b"[" * 11 + b"]" * 11)
        assert response.status_code == 400
        assert "deeper than 10 levels" in response.data["detail"]

    def test_other_errors_are_drf_parse_errors_as_before(self):
        response = self.post(b"{not json")
        assert response.status_code == 400
        assert response.data["detail"].startswith("JSON parse error")


class TestChunkedBody:
    """Without Content-Length (Transfer-Encoding: chunked), Django under WSGI reads no body."""

    def test_a_keyed_chunked_request_is_refused_before_the_key_is_claimed(self, alice, key):
        payment = Payment.objects.create(amount=1)
        url = f"/api/viewset-payments/{payment.pk}/"
        headers = {"Authorization": basic_auth(alice), "Idempotency-Key": key}
        response = send_chunked(ApiClient(), "PATCH", url, b'{"amount": 9}', headers=headers)

        assert response.status_code == 411
        assert problem(response)["code"] == "idempotency.length_required"
        assert not IdempotencyKey.objects.exists()
        payment.refresh_from_db()
        assert payment.amount == 1
        # The key is not burnt: the retry with a Content-Length runs.
        retry = ApiClient(alice).send("PATCH", url, {"amount": 9}, key=key)
        assert (retry.status_code, retry["Idempotency-Status"]) == (200, "stored")
        payment.refresh_from_db()
        assert payment.amount == 9

    @pytest.mark.parametrize("path", ["/payments/", "/plain/"])
    def test_refused_on_every_adapter(self, alice, key, path):
        headers = {"Authorization": basic_auth(alice), "Idempotency-Key": key}
        response = send_chunked(ApiClient(), "POST", path, b'{"amount": 9}', headers=headers)
        assert response.status_code == 411
        assert problem(response)["code"] == "idempotency.length_required"
        assert effects() == (0, 0, 0)

    def test_without_a_key_the_view_decides(self, alice):
        headers = {"Authorization": basic_auth(alice)}
        response = send_chunked(
            ApiClient(), "POST", "/optional/", b'{"amount": 9}', headers=headers
        )
        assert response.status_code == 400  # DRF: the (empty) body has no amount
        assert effects() == (0, 0, 0)

    @pytest.mark.django_db(transaction=True)
    def test_over_http(self, alice, key, live_server):
        # The whole request in one write: the server answers 411 without reading the body, and
        # a body sent chunk by chunk could meet the closed connection (a broken pipe).
        host, port = live_server.thread.host, live_server.thread.port
        head = (
            f"POST /payments/ HTTP/1.1\r\nHost: {host}\r\nAuthorization: {basic_auth(alice)}\r\n"
            f"Content-Type: application/json\r\nIdempotency-Key: {key}\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        body = b'a\r\n{"amount":\r\n2\r\n 9\r\n0\r\n\r\n'
        with socket.create_connection((host, port)) as sock:
            sock.sendall(head.encode() + body)
            response = http.client.HTTPResponse(sock)
            response.begin()
            status, body = response.status, json.loads(response.read())

        assert (status, body["code"]) == (411, "idempotency.length_required")
        assert effects() == (0, 0, 0)
