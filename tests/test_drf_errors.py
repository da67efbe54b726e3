"""The opt-in exception handler answers the REST framework's errors as problems with advice."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.db import OperationalError
from django.http import Http404
from django.test import override_settings
from django.urls import include, path
from rest_framework import exceptions
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import problems
from django_idempotency.drf_errors import DependencyTimeout, DependencyUnavailable
from tests.conftest import ApiClient
from tests.testapp.models import Payment

HANDLER = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.BasicAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "django_idempotency.drf_errors.problem_exception_handler",
}


class CardDeclined(exceptions.APIException):
    status_code = 402
    default_detail = "The card was declined."


class NamedCardDeclined(CardDeclined):
    problem = problems.Problem(
        "payment.card_declined", 402, "The card was declined", retryable=False, retry="new_key"
    )


RAISED = {
    "not-found": exceptions.NotFound(),
    "http404": Http404("No such payment."),
    "django-permission": DjangoPermissionDenied(),
    "dependency": DependencyUnavailable(wait=7),
    "timeout": DependencyTimeout(),
    "server": exceptions.APIException(),
    "declined": CardDeclined(),
    "named": NamedCardDeclined(),
    "database": OperationalError("server closed the connection unexpectedly"),
    "list": exceptions.ValidationError("Pick one of the two."),
    "conflict-fields": exceptions.APIException({"slot": "taken"}),
}


class Raising(APIView):
    """Raises the exception its URL names, as a view that calls a provider would."""

    permission_classes = [AllowAny]

    def get(self, request, name):
        raise RAISED[name]


class Plain(APIView):
    permission_classes = [AllowAny]

    def get(self, request):
        return Response({"ok": True})


urlpatterns = [
    path("raise/<str:name>/", Raising.as_view()),
    path("plain/", Plain.as_view()),
    path("", include("tests.testapp.urls")),
]

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.usefixtures("handler"),
]


@pytest.fixture
def handler():
    with override_settings(REST_FRAMEWORK=HANDLER, ROOT_URLCONF=__name__):
        yield


def problem(response, code, status):
    """Assert ``response`` is the problem ``code`` with ``status``, and return its body."""
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body["code"] == code
    assert body["type"] == problems.TYPE_PREFIX + code
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    return body


def test_invalid_data_keeps_the_field_errors_and_its_key_for_the_corrected_retry(client_alice, key):
    response = client_alice.send("POST", "/payments/", {"amount": -5}, key=key)
    body = problem(response, "validation.invalid", 400)
    assert body["retryable"] is False
    assert body["retry"] == "same_key"
    assert list(body["errors"]) == ["amount"]
    assert body["errors"]["amount"][0].startswith("Ensure this value")
    assert body["detail"] == "The request is invalid; see errors."

    # The advice holds: the 400 was not kept, so the corrected request runs under the same key.
    corrected = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert corrected.status_code == 201
    assert corrected["Idempotency-Status"] == "stored"


def test_a_validation_error_after_a_write_rolls_it_back(client_alice, key):
    headers = {"X-Fail": "validation"}
    response = client_alice.send("POST", "/payments/", {"amount": 5}, key=key, headers=headers)
    errors = problem(response, "validation.invalid", 400)["errors"]
    assert errors == {"amount": "rejected after the write"}  # as DRF would have sent it
    assert not Payment.objects.exists()


def test_a_list_of_messages_is_kept_as_a_list():
    body = problem(ApiClient().get("/raise/list/"), "validation.invalid", 400)
    assert body["errors"] == ["Pick one of the two."]


def test_any_error_raised_with_fields_keeps_them():
    body = problem(ApiClient().get("/raise/conflict-fields/"), "server.error", 500)
    assert body["errors"] == {"slot": "taken"}
    assert body["detail"] == "The request could not be completed; see errors."


def test_a_body_that_cannot_be_parsed_is_invalid_too(client_alice, key):
    response = client_alice.send("POST", "/payments/", "{not json", key=key)
    body = problem(response, "validation.invalid", 400)
    assert body["detail"].startswith("JSON parse error")
    assert body["errors"] == [body["detail"]]
    assert body["retry"] == "same_key"


def test_an_unsupported_media_type_is_not_kept_so_the_corrected_retry_runs(client_alice, key):
    response = client_alice.send("POST", "/payments/", "amount", key=key, content_type="text/csv")
    body = problem(response, "validation.unsupported_media_type", 415)
    assert body["retry"] == "same_key"
    corrected = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert (corrected.status_code, corrected["Idempotency-Status"]) == (201, "stored")


def test_no_credentials_is_not_authenticated_with_the_challenge(key):
    response = ApiClient().send("POST", "/payments/", {"amount": 5}, key=key)
    body = problem(response, "auth.not_authenticated", 401)
    assert response["WWW-Authenticate"].startswith("Basic")
    assert (body["retryable"], body["retry"]) == (False, "same_key")


def test_wrong_credentials_fail_authentication(key):
    headers = {"Authorization": "Basic bm9ib2R5Om5vcGU="}  # nobody:nope
    response = ApiClient().send("POST", "/payments/", {"amount": 5}, key=key, headers=headers)
    problem(response, "auth.authentication_failed", 401)


def test_a_permission_denied_is_final():
    body = problem(ApiClient().get("/raise/django-permission/"), "auth.permission_denied", 403)
    assert (body["retryable"], body["retry"]) == (False, "no")


@pytest.mark.parametrize(("name", "detail"), [("not-found", "Not found."), ("http404", None)])
def test_not_found(name, detail):
    body = problem(ApiClient().get(f"/raise/{name}/"), "not_found", 404)
    assert body["retry"] == "no"
    if detail:
        assert body["detail"] == detail


def test_a_method_the_view_lacks_is_not_allowed(client_alice, key):
    response = client_alice.send("PATCH", "/payments/", {"amount": 5}, key=key)
    assert problem(response, "method_not_allowed", 405)["retry"] == "no"
    assert "POST" in response["Allow"]


def test_an_unacceptable_accept_header():
    response = ApiClient().get("/plain/", headers={"Accept": "application/xml"})
    problem(response, "not_acceptable", 406)


def test_a_throttled_request_is_retried_with_the_same_key_after_retry_after(client_alice):
    for n in range(2):
        assert client_alice.send("POST", "/throttled/", {"amount": 5}, key=f"k{n}").status_code == (
            201
        )
    response = client_alice.send("POST", "/throttled/", {"amount": 5}, key="k2")
    body = problem(response, "rate_limit.exceeded", 429)
    assert (body["retryable"], body["retry"]) == (True, "same_key")
    assert int(response["Retry-After"]) > 0


def test_a_dependency_that_is_down_invites_a_retry_after_its_wait():
    response = ApiClient().get("/raise/dependency/")
    body = problem(response, "dependency.unavailable", 503)
    assert (body["retryable"], body["retry"]) == (True, "same_key")
    assert response["Retry-After"] == "7"


def test_a_dependency_timeout_is_transient_and_has_no_retry_after_unless_given():
    response = ApiClient().get("/raise/timeout/")
    body = problem(response, "transient.timeout", 504)
    assert (body["retryable"], body["retry"]) == (True, "same_key")
    assert not response.has_header("Retry-After")


@pytest.mark.parametrize(
    ("name", "code", "status", "retry"),
    [
        ("server", "server.error", 500, "same_key"),
        ("declined", "request.rejected", 402, "no"),
        ("named", "payment.card_declined", 402, "new_key"),
    ],
)
def test_other_api_errors_get_a_code_by_status_or_their_own(name, code, status, retry):
    assert problem(ApiClient().get(f"/raise/{name}/"), code, status)["retry"] == retry


def test_a_database_failure_in_any_view_is_the_retryable_503():
    response = ApiClient().get("/raise/database/")
    problem(response, "idempotency.unavailable", 503)
    assert response["Retry-After"] == "1"


def test_an_exception_outside_the_rest_framework_is_left_to_django():
    RAISED["bare"] = RuntimeError("a bug")
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            ApiClient().get("/raise/bare/")
    finally:
        del RAISED["bare"]


@pytest.mark.parametrize(
    ("key", "code"), [(None, "idempotency.key_missing"), ("", "idempotency.key_invalid")]
)
def test_the_librarys_own_problems_are_unchanged(client_alice, key, code):
    with_handler = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    drf_default = {**HANDLER, "EXCEPTION_HANDLER": "rest_framework.views.exception_handler"}
    with override_settings(REST_FRAMEWORK=drf_default):
        without = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert with_handler.status_code == without.status_code == 400
    assert with_handler.content == without.content
    assert "retryable" not in problem(with_handler, code, 400)


def test_a_payload_mismatch_keeps_its_code_with_the_handler(client_alice, key):
    assert client_alice.send("POST", "/payments/", {"amount": 5}, key=key).status_code == 201
    response = client_alice.send("POST", "/payments/", {"amount": 6}, key=key)
    problem(response, "idempotency.payload_mismatch", 422)


def test_a_success_is_untouched(client_alice, key):
    response = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert response.status_code == 201
    assert response["Content-Type"] == "application/json"


@pytest.mark.parametrize("problem_type", problems.API_ERRORS, ids=lambda p: p.code)
def test_every_code_has_advice_and_is_documented(problem_type):
    assert isinstance(problem_type.retryable, bool)
    assert problem_type.retry in {"same_key", "new_key", "no"}
    page = (Path(__file__).resolve().parent.parent / "docs" / "errors.md").read_text()
    assert f"`{problem_type.code}`" in page


CONFIGURED_WITH_THE_PARSER = textwrap.dedent(
    """
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.auth", "django.contrib.contenttypes", "django_idempotency"
        ],
        REST_FRAMEWORK={
            "DEFAULT_PARSER_CLASSES": ["django_idempotency.drf.JSONParser"],
            "EXCEPTION_HANDLER": "django_idempotency.drf_errors.problem_exception_handler",
        },
    )
    django.setup()
    import django_idempotency.drf
    from rest_framework.views import APIView

    print(APIView().get_exception_handler().__module__, APIView.parser_classes[0].__module__)
    """
)


def test_the_handler_and_the_parser_can_be_set_together():
    # rest_framework.views reads DEFAULT_PARSER_CLASSES on import: importing it from the module
    # that defines the parser would be an import circle.
    completed = subprocess.run(
        [sys.executable, "-c", CONFIGURED_WITH_THE_PARSER],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.split() == ["django_idempotency.drf_errors", "django_idempotency.drf"]
