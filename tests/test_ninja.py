"""The HTTP contract (DESIGN §2) through the Django Ninja adapter, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from django.contrib.auth import authenticate
from django.core.exceptions import ImproperlyConfigured
from django.db import OperationalError, connection
from django.http import HttpResponse  # noqa: TC002 - Ninja resolves annotations at runtime
from django.test import override_settings
from django.urls import path
from ninja import JSONL, Form, NinjaAPI, Router, Schema, Status
from ninja.errors import HttpError, ValidationError
from ninja.security import APIKeyHeader, HttpBasicAuth

from django_idempotency.models import IdempotencyKey
from django_idempotency.ninja import idempotent
from tests.conftest import ApiClient, send_chunked
from tests.test_store import start, wait_for_key_held
from tests.testapp import provider
from tests.testapp.models import Charge, LedgerEntry, Payment

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]


class BasicAuth(HttpBasicAuth):
    def authenticate(self, request, username, password):
        return authenticate(request, username=username, password=password)


class FailingAuth(HttpBasicAuth):
    def authenticate(self, request, username, password):
        raise OperationalError("the server closed the connection")


class TokenAuth(APIKeyHeader):
    param_name = "X-Token"

    def authenticate(self, request, key):
        return key or None


class PaymentIn(Schema):
    amount: int
    currency: str = "EUR"
    metadata: dict[str, Any] = {}


class PaymentOut(Schema):
    id: int
    amount: int
    currency: str


router = Router()


@router.post(
    "/payments/", response={201: PaymentOut, 402: dict}, auth=[BasicAuth(), lambda request: True]
)
@idempotent()
def create_payment(request, payload: PaymentIn):
    user = request.auth if request.auth is not True else None
    payment = Payment.objects.create(
        owner=user, amount=payload.amount, currency=payload.currency, metadata=payload.metadata
    )
    LedgerEntry.objects.create(payment=payment, amount=payment.amount)
    if hold := request.headers.get("X-Hold"):
        time.sleep(float(hold))
    if request.headers.get("X-Fail") == "declined":
        raise HttpError(402, "card declined")
    if request.headers.get("X-Fail") == "exception":
        raise RuntimeError("boom after the write")
    if request.headers.get("X-Fail") == "invalid":
        raise ValidationError([{"loc": ["body", "amount"], "msg": "refused after the write"}])
    return Status(201, payment)


@router.post("/required/", response={201: PaymentOut}, auth=BasicAuth())
@idempotent(required=True, ttl=5400)
def create_required(request, payload: PaymentIn):
    payment = Payment.objects.create(owner=request.auth, amount=payload.amount)
    return Status(201, payment)


@router.post("/tokens/", auth=TokenAuth())
@idempotent(required=True)
def create_with_token(request, payload: PaymentIn):
    payment = Payment.objects.create(amount=payload.amount)
    return {"id": payment.pk}


@router.post("/async/", response={201: PaymentOut})
@idempotent
async def create_async(request, payload: PaymentIn):
    payment = await Payment.objects.acreate(amount=payload.amount)
    return Status(201, payment)


@router.post("/notes/")
@idempotent()
def create_note(request, response: HttpResponse, text: Form[str]):
    payment = Payment.objects.create(amount=len(text))
    response["X-Note"] = f"note-{payment.pk}"
    return {"id": payment.pk, "text": text}


@router.patch("/notes/")
@idempotent()
def replace_notes(request):
    return {"count": Payment.objects.create(amount=1).pk}


recovered = []


def recover_charge(request, *, key, attempt):
    recovered.append((key, attempt))
    charge = provider.find_charge(key)
    if charge is None:
        return None
    payment = Payment.objects.create(amount=charge.amount, reference=key)
    return Status(201, {"id": payment.pk, "recovered": True})


@router.post("/lease/", response={201: dict})
@idempotent(mode="lease", recover=recover_charge)
def create_leased(request, payload: PaymentIn):
    key = request.headers["Idempotency-Key"]
    provider.charge(key, payload.amount)
    if request.headers.get("X-Fail") == "exception":
        raise RuntimeError("boom after the charge")
    payment = Payment.objects.create(amount=payload.amount, reference=key)
    return Status(201, {"id": payment.pk, "recovered": False})


@router.post("/failover/", auth=FailingAuth())
@idempotent()
def after_failover(request, payload: PaymentIn):
    return {"id": Payment.objects.create(amount=payload.amount).pk}


@router.get("/payments/")
def list_payments(request):
    return {"count": Payment.objects.count()}


api = NinjaAPI(urls_namespace="ninja-tests")
api.add_router("/", router)

urlpatterns = [path("api/", api.urls)]


def problem(response) -> dict:
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert set(body) == {"type", "title", "status", "detail", "code"}
    assert body["status"] == response.status_code
    return body


def effects() -> tuple[int, int, int]:
    return Payment.objects.count(), LedgerEntry.objects.count(), IdempotencyKey.objects.count()


class TestFirstRequestAndReplay:
    def test_first_request_runs_and_is_stored(self, client_alice, alice, key):
        response = client_alice.send("POST", "/api/payments/", {"amount": 1000}, key=key)

        assert response.status_code == 201
        assert response["Idempotency-Status"] == "stored"
        assert effects() == (1, 1, 1)
        assert Payment.objects.get().owner == alice
        row = IdempotencyKey.objects.get()
        assert row.state == IdempotencyKey.State.SUCCEEDED
        assert row.route == "api/payments/"
        assert row.response_status == 201
        assert bytes(row.response_body) == response.content
        assert row.scope.startswith(f"auth.user:{alice.pk} POST ")

    def test_replay_returns_the_stored_answer_without_running_again(self, client_alice, key):
        first = client_alice.send("POST", "/api/payments/", {"amount": 1000}, key=key)
        second = client_alice.send("POST", "/api/payments/", {"amount": 1000}, key=key)

        assert second.status_code == 201
        assert second.content == first.content
        assert second["Idempotency-Status"] == "replayed"
        assert second["Idempotent-Replayed"] == "true"
        assert effects() == (1, 1, 1)

    @override_settings(IDEMPOTENCY={"KEY_REQUIRED": False})
    def test_without_an_optional_key_the_operation_runs_each_time(self, client_alice):
        for _ in range(2):
            assert client_alice.send("POST", "/api/payments/", {"amount": 5}).status_code == 201
        assert effects() == (2, 2, 0)

    def test_a_safe_method_is_left_alone(self, client_alice, key):
        response = client_alice.send("GET", "/api/payments/", key=key)

        assert response.status_code == 200
        assert "Idempotency-Status" not in response

    def test_an_async_operation_is_stored_and_replayed(self, key):
        client = ApiClient()
        first = client.send("POST", "/api/async/", {"amount": 3}, key=key)
        second = client.send("POST", "/api/async/", {"amount": 3}, key=key)

        assert first.status_code == second.status_code == 201
        assert second["Idempotency-Status"] == "replayed"
        assert second.content == first.content
        assert Payment.objects.count() == 1


class TestRefusals:
    def test_the_same_key_with_another_payload_is_a_422_mismatch(self, client_alice, key):
        client_alice.send("POST", "/api/payments/", {"amount": 1000}, key=key)
        response = client_alice.send("POST", "/api/payments/", {"amount": 2000}, key=key)

        assert response.status_code == 422
        assert problem(response)["code"] == "idempotency.payload_mismatch"
        assert effects() == (1, 1, 1)

    def test_a_missing_required_key_is_a_400(self, client_alice):
        response = client_alice.send("POST", "/api/payments/", {"amount": 1})

        assert response.status_code == 400
        assert problem(response)["code"] == "idempotency.key_missing"
        assert Payment.objects.count() == 0

    def test_a_malformed_key_is_a_400(self, client_alice):
        response = client_alice.send("POST", "/api/required/", {"amount": 1}, key="a,b")

        assert response.status_code == 400
        assert problem(response)["code"] == "idempotency.key_invalid"

    def test_authentication_runs_first_and_a_refused_request_claims_nothing(self, key):
        response = ApiClient().send("POST", "/api/required/", {"amount": 1}, key=key)

        assert response.status_code == 401
        assert effects() == (0, 0, 0)

    # The answer marks every open transaction for rollback: the test's own too.
    @pytest.mark.django_db(transaction=True)
    def test_a_database_failure_in_authentication_is_a_503_problem(self, client_alice, key):
        response = client_alice.send("POST", "/api/failover/", {"amount": 1}, key=key)

        assert response.status_code == 503
        assert problem(response)["code"] == "idempotency.unavailable"
        assert "Retry-After" in response
        assert effects() == (0, 0, 0)

    @override_settings(IDEMPOTENCY={"ANONYMOUS": "reject"})
    def test_an_anonymous_key_is_refused_when_the_setting_says_so(self, key):
        response = ApiClient().send("POST", "/api/payments/", {"amount": 1}, key=key)

        assert response.status_code == 403
        assert problem(response)["code"] == "idempotency.anonymous_rejected"
        assert effects() == (0, 0, 0)


class TestWhatIsStored:
    def test_ninjas_validation_error_keeps_nothing_and_the_corrected_retry_runs(
        self, client_alice, key
    ):
        invalid = client_alice.send("POST", "/api/payments/", {"amount": "lots"}, key=key)
        assert invalid.status_code == 422
        assert "Idempotency-Status" not in invalid
        assert effects() == (0, 0, 0)

        corrected = client_alice.send("POST", "/api/payments/", {"amount": 10}, key=key)
        assert corrected.status_code == 201
        assert corrected["Idempotency-Status"] == "stored"
        assert effects() == (1, 1, 1)

    @pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
    def test_nan_or_an_infinity_keeps_nothing_and_the_corrected_retry_runs(
        self, client_alice, key, number
    ):
        # Ninja's parser (json.loads) and its schema take them; the database would not.
        body = f'{{"amount": 5, "metadata": {{"rate": {number}}}}}'
        refused = client_alice.send("POST", "/api/payments/", body, key=key)
        assert refused.status_code == 400
        assert problem(refused)["code"] == "idempotency.body_invalid"
        assert effects() == (0, 0, 0)

        corrected = client_alice.send(
            "POST", "/api/payments/", {"amount": 5, "metadata": {"rate": 1.5}}, key=key
        )
        assert corrected.status_code == 201
        assert Payment.objects.get().metadata == {"rate": 1.5}

    def test_a_body_without_content_length_is_refused_before_the_key_is_claimed(self, key):
        # Without Content-Length Django reads no body. An operation that parses one refuses
        # the empty body itself (Ninja's 422); one that does not gets to the fingerprint.
        headers = {"Idempotency-Key": key}
        response = send_chunked(ApiClient(), "PATCH", "/api/notes/", b"{}", headers=headers)
        assert response.status_code == 411
        assert problem(response)["code"] == "idempotency.length_required"
        assert not IdempotencyKey.objects.exists()
        assert not Payment.objects.exists()

    def test_json_deeper_than_mariadb_stores_keeps_nothing_and_the_corrected_retry_runs(
        self, client_alice, key
    ):
        # MariaDB's JSON check refuses 32 levels: such metadata reached its insert, and the
        # IntegrityError was a 500. The default depth limit is what every database stores.
        deep = {"amount": 5, "metadata": {"a": json.loads("[" * 38 + "]" * 38)}}
        refused = client_alice.send("POST", "/api/payments/", deep, key=key)
        assert refused.status_code == 400
        assert problem(refused)["detail"] == "The JSON body is nested deeper than 31 levels."
        assert effects() == (0, 0, 0)

        corrected = client_alice.send(
            "POST", "/api/payments/", {"amount": 5, "metadata": {"a": [[]]}}, key=key
        )
        assert corrected.status_code == 201
        assert effects() == (1, 1, 1)

    def test_an_http_error_after_the_write_is_stored_and_replayed(self, client_alice, key):
        headers = {"X-Fail": "declined"}
        first = client_alice.send("POST", "/api/payments/", {"amount": 1}, key=key, headers=headers)
        second = client_alice.send(
            "POST", "/api/payments/", {"amount": 1}, key=key, headers=headers
        )

        assert first.status_code == second.status_code == 402
        assert json.loads(first.content) == {"detail": "card declined"}
        assert second["Idempotency-Status"] == "replayed"
        assert effects() == (1, 1, 1)

    def test_a_validation_error_raised_by_the_operation_keeps_nothing(self, client_alice, key):
        headers = {"X-Fail": "invalid"}
        first = client_alice.send("POST", "/api/payments/", {"amount": 1}, key=key, headers=headers)
        assert first.status_code == 422
        assert "Idempotency-Status" not in first
        assert effects() == (0, 0, 0)

        retry = client_alice.send("POST", "/api/payments/", {"amount": 1}, key=key)
        assert retry["Idempotency-Status"] == "stored"

    def test_an_unhandled_error_rolls_back_the_write_and_the_key(self, key):
        client = ApiClient(raise_request_exception=False)
        headers = {"X-Fail": "exception"}
        response = client.send("POST", "/api/payments/", {"amount": 1}, key=key, headers=headers)

        assert response.status_code == 500
        assert effects() == (0, 0, 0)


class TestResponses:
    def test_headers_set_on_ninjas_response_are_stored_and_replayed(self, client_alice, key):
        def send():
            return client_alice.send(
                "POST",
                "/api/notes/",
                "text=hello",
                key=key,
                content_type="application/x-www-form-urlencoded",
            )

        first, second = send(), send()

        assert first.status_code == second.status_code == 200
        assert first["X-Note"] == second["X-Note"] == f"note-{Payment.objects.get().pk}"
        assert second["Idempotency-Status"] == "replayed"

    def test_a_multipart_form_is_fingerprinted(self, alice, key):
        client = ApiClient(alice)
        headers = {"Idempotency-Key": key}
        first = client.post("/api/notes/", {"text": "one"}, headers=headers)
        same = client.post("/api/notes/", {"text": "one"}, headers=headers)
        other = client.post("/api/notes/", {"text": "two"}, headers=headers)

        assert first.status_code == 200
        assert same["Idempotency-Status"] == "replayed"
        assert other.status_code == 422
        assert problem(other)["code"] == "idempotency.payload_mismatch"

    def test_a_multipart_patch_is_fingerprinted_by_its_fields(self, key):
        from django.test.client import encode_multipart  # noqa: PLC0415

        def send(text):
            body = encode_multipart("BoUnDaRy", {"text": text})
            return ApiClient().patch(
                "/api/notes/",
                body,
                content_type="multipart/form-data; boundary=BoUnDaRy",
                headers={"Idempotency-Key": key},
            )

        assert send("one").status_code == 200
        assert send("one")["Idempotency-Status"] == "replayed"
        other = send("two")
        assert other.status_code == 422
        assert problem(other)["code"] == "idempotency.payload_mismatch"


@pytest.mark.django_db(transaction=True)
class TestLeaseMode:
    def test_a_failed_request_releases_its_key_and_the_retry_recovers(self, alice, key):
        recovered.clear()
        client = ApiClient(alice, raise_request_exception=False)
        failed = client.send(
            "POST", "/api/lease/", {"amount": 5}, key=key, headers={"X-Fail": "exception"}
        )
        assert failed.status_code == 500
        assert IdempotencyKey.objects.get().state == IdempotencyKey.State.FAILED
        assert Payment.objects.count() == 0

        retry = client.send("POST", "/api/lease/", {"amount": 5}, key=key)

        assert retry.status_code == 201
        assert retry["Idempotency-Status"] == "stored"
        assert json.loads(retry.content) == {"id": Payment.objects.get().pk, "recovered": True}
        assert recovered == [(key, 2)]
        assert Charge.objects.get().calls == 1


class TestScope:
    def test_the_same_key_from_two_users_is_two_operations(self, client_alice, client_bob, key):
        first = client_alice.send("POST", "/api/payments/", {"amount": 1}, key=key)
        second = client_bob.send("POST", "/api/payments/", {"amount": 1}, key=key)

        assert first["Idempotency-Status"] == second["Idempotency-Status"] == "stored"
        assert effects() == (2, 2, 2)

    def test_anonymous_and_authenticated_requests_do_not_share_keys(self, client_alice, key):
        ApiClient().send("POST", "/api/payments/", {"amount": 1}, key=key)
        response = client_alice.send("POST", "/api/payments/", {"amount": 1}, key=key)

        assert response["Idempotency-Status"] == "stored"
        scopes = sorted(row.scope.split()[0] for row in IdempotencyKey.objects.all())
        assert scopes[0] == "anonymous"
        assert scopes[1].startswith("auth.user:")

    def test_a_token_scopes_by_its_digest_never_the_token_itself(self, key):
        def send(token):
            headers = {"X-Token": token}
            return ApiClient().send("POST", "/api/tokens/", {"amount": 1}, key=key, headers=headers)

        first, replay, other = send("secret-a"), send("secret-a"), send("secret-b")

        assert first["Idempotency-Status"] == "stored"
        assert replay["Idempotency-Status"] == "replayed"
        assert other["Idempotency-Status"] == "stored"
        scopes = [row.scope for row in IdempotencyKey.objects.all()]
        assert all(scope.startswith("token:") for scope in scopes)
        assert not any("secret" in scope for scope in scopes)

    def test_a_scope_function_setting_decides_and_sees_ninjas_principal(self, alice, key):
        with override_settings(IDEMPOTENCY={"SCOPE_FUNCTION": principal_scope}):
            response = ApiClient(alice).send("POST", "/api/required/", {"amount": 1}, key=key)

        assert response["Idempotency-Status"] == "stored"
        assert IdempotencyKey.objects.get().scope == "principal-alice"

    def test_a_scope_function_option_decides(self, key):
        def tenant_scope(request, route):
            return f"tenant-{request.headers['X-Tenant']}"

        local = Router()

        @local.post("/tenant/")
        @idempotent(scope_function=tenant_scope)
        def create(request, payload: PaymentIn):
            return {"id": Payment.objects.create(amount=payload.amount).pk}

        local_api = NinjaAPI(urls_namespace="ninja-tenant")
        local_api.add_router("/", local)
        with override_settings(ROOT_URLCONF=_urlconf(local_api)):
            response = ApiClient().send(
                "POST", "/api/tenant/", {"amount": 1}, key=key, headers={"X-Tenant": "acme"}
            )
        assert response["Idempotency-Status"] == "stored"
        assert IdempotencyKey.objects.get().scope == "tenant-acme"


def principal_scope(request, route):
    return f"principal-{request.auth.username}"


def _urlconf(ninja_api):
    """A module-like urlconf serving ``ninja_api`` under /api/."""

    class URLConf:
        urlpatterns = [path("api/", ninja_api.urls)]

    return URLConf


class TestMountedTwice:
    def test_a_router_mounted_in_two_apis_works_and_is_documented_in_each(self, key):
        shared = Router()

        @shared.post("/things/")
        @idempotent()
        def create_thing(request, payload: PaymentIn):
            return {"id": Payment.objects.create(amount=payload.amount).pk}

        first_api = NinjaAPI(urls_namespace="ninja-first")
        second_api = NinjaAPI(urls_namespace="ninja-second")
        first_api.add_router("/", shared)
        second_api.add_router("/", shared)

        class URLConf:
            urlpatterns = [path("one/", first_api.urls), path("two/", second_api.urls)]

        client = ApiClient()
        with override_settings(ROOT_URLCONF=URLConf):
            one = client.send("POST", "/one/things/", {"amount": 1}, key=key)
            two = client.send("POST", "/two/things/", {"amount": 1}, key=key)
            again = client.send("POST", "/two/things/", {"amount": 1}, key=key)
            schemas = [
                json.loads(client.get(f"/{name}/openapi.json").content) for name in ("one", "two")
            ]

        # The route is part of the scope: the two mounts are two endpoints.
        assert one["Idempotency-Status"] == two["Idempotency-Status"] == "stored"
        assert again["Idempotency-Status"] == "replayed"
        for schema in schemas:
            parameters = schema["paths"][next(iter(schema["paths"]))]["post"]["parameters"]
            assert [p["name"] for p in parameters].count("Idempotency-Key") == 1


class TestDecoratorPlacement:
    def test_above_the_operation_decorator_is_refused(self):
        local = Router()
        with pytest.raises(ImproperlyConfigured, match=r"under @api\.post"):

            @idempotent()
            @local.post("/wrong/")
            def wrong(request):
                return {}

    def test_a_streaming_operation_is_refused(self):
        local = Router()
        with pytest.raises(ImproperlyConfigured, match="streamed"):

            @local.post("/stream/", response=JSONL[int])
            @idempotent()
            def stream(request):
                yield 1

    def test_an_unknown_option_is_refused(self):
        with pytest.raises(TypeError, match="Unknown idempotency options: colour"):
            idempotent(colour="blue")  # type: ignore[call-arg]


class TestOpenAPI:
    def schema(self):
        response = ApiClient().get("/api/openapi.json")
        assert response.status_code == 200
        return json.loads(response.content)

    def test_the_key_header_is_documented_with_its_format_and_lifetime(self):
        operation = self.schema()["paths"]["/api/required/"]["post"]
        [header] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]

        assert header["in"] == "header"
        assert header["required"] is True
        assert "90 minutes" in header["description"]
        assert header["x-idempotency-key-ttl-seconds"] == 5400
        assert header["schema"]["maxLength"] == 255

    def test_the_header_follows_the_settings_at_schema_time(self):
        with override_settings(IDEMPOTENCY={"KEY_REQUIRED": False, "TTL": 7200}):
            operation = self.schema()["paths"]["/api/payments/"]["post"]
        [header] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
        assert header["required"] is False
        assert "2 hours" in header["description"]
        operation = self.schema()["paths"]["/api/payments/"]["post"]
        [header] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
        assert header["required"] is True
        assert "24 hours" in header["description"]

    def test_the_problem_answers_are_documented(self):
        operation = self.schema()["paths"]["/api/payments/"]["post"]
        responses = operation["responses"]

        for status in ("400", "409", "422", "503"):
            content = responses[status]["content"]["application/problem+json"]
            assert "idempotency.payload_mismatch" in content["schema"]["properties"]["code"]["enum"]
        assert "Retry-After" in responses["409"]["headers"]
        assert "403" not in responses
        assert "Idempotency-Status" in responses["201"]["headers"]
        assert "content" in responses["201"]  # Ninja's own documentation stays

    @override_settings(IDEMPOTENCY={"ANONYMOUS": "reject"})
    def test_the_anonymous_refusal_is_documented_when_set(self):
        responses = self.schema()["paths"]["/api/payments/"]["post"]["responses"]
        assert "403" in responses

    def test_a_safe_operation_is_not_documented(self):
        operation = self.schema()["paths"]["/api/payments/"]["get"]
        assert not any(p["name"] == "Idempotency-Key" for p in operation.get("parameters", []))

    def test_the_header_is_documented_once(self):
        operation = self.schema()["paths"]["/api/payments/"]["post"]
        names = [p["name"] for p in operation["parameters"]]
        assert names.count("Idempotency-Key") == 1


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
class TestConcurrency:
    def test_a_duplicate_sent_while_the_first_runs_waits_and_replays(self, alice, key):
        results = {}

        def send(name, hold):
            try:
                headers = {"X-Hold": hold} if hold else {}
                results[name] = ApiClient(alice).send(
                    "POST", "/api/payments/", {"amount": 7}, key=key, headers=headers
                )
            finally:
                connection.close()

        first = threading.Thread(target=send, args=("first", "0.5"))
        first.start()
        deadline = time.monotonic() + 5
        while not Payment.objects.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        # Under atomic mode the first request's rows are not committed yet: look at the lock.
        second = threading.Thread(target=send, args=("second", None))
        second.start()
        first.join(10)
        second.join(10)

        assert results["first"].status_code == results["second"].status_code == 201
        assert results["first"]["Idempotency-Status"] == "stored"
        assert results["second"]["Idempotency-Status"] == "replayed"
        assert results["second"].content == results["first"].content
        assert effects() == (1, 1, 1)

    @override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.2})
    def test_a_duplicate_that_waits_too_long_gets_a_409(self, alice, key):
        # The first request holds its key far longer than the duplicate's wait, which MariaDB
        # rounds up to whole seconds; the duplicate is sent once the first one's claim is in.
        first = start(
            lambda: ApiClient(alice).send(
                "POST", "/api/payments/", {"amount": 7}, key=key, headers={"X-Hold": "3"}
            )
        )
        wait_for_key_held()
        second = ApiClient(alice).send("POST", "/api/payments/", {"amount": 7}, key=key)

        assert first().status_code == 201
        assert second.status_code == 409
        assert problem(second)["code"] == "idempotency.in_progress"
        assert "Retry-After" in second
        assert effects() == (1, 1, 1)

    def test_many_concurrent_duplicates_make_one_effect(self, alice, key):
        count = 8
        barrier = threading.Barrier(count)
        statuses = []
        errors = []

        def send():
            try:
                barrier.wait()
                response = ApiClient(alice).send("POST", "/api/payments/", {"amount": 9}, key=key)
                statuses.append((response.status_code, response["Idempotency-Status"]))
            except BaseException as exc:
                errors.append(exc)
            finally:
                connection.close()

        threads = [threading.Thread(target=send) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)

        assert not errors, errors
        assert sorted(statuses) == [(201, "replayed")] * (count - 1) + [(201, "stored")]
        assert effects() == (1, 1, 1)
