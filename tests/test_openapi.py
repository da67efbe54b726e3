"""The OpenAPI schema (drf-spectacular) documents idempotent and conditional operations."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import override_settings
from django.urls import path
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.validation import validate_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import problems
from django_idempotency.drf import IdempotentMixin
from django_idempotency.keys import InvalidKey, parse_key

PROBLEM = {"$ref": "#/components/schemas/IdempotencyProblem"}


@pytest.fixture(scope="module")
def schema():
    generated = SchemaGenerator().get_schema(request=None, public=True)
    validate_schema(generated)  # a valid OpenAPI 3 document, extension included
    return generated


def operation(schema, path, method):
    return schema["paths"][path][method]


def header(op, name):
    found = [p for p in op.get("parameters", []) if p["in"] == "header" and p["name"] == name]
    return found[0] if found else None


def test_an_idempotent_operation_documents_the_key_its_errors_and_its_replays(schema):
    op = operation(schema, "/payments/", "post")
    key = header(op, "Idempotency-Key")
    assert key["required"] is True
    assert key["schema"]["maxLength"] == 255
    for status in ("400", "409", "422"):
        assert op["responses"][status]["content"]["application/problem+json"]["schema"] == PROBLEM
    success = [response for status, response in op["responses"].items() if status.startswith("2")]
    assert success
    for response in success:
        assert set(response["headers"]) >= {"Idempotency-Status", "Idempotent-Replayed"}
    problem = schema["components"]["schemas"]["IdempotencyProblem"]
    assert "idempotency.payload_mismatch" in problem["properties"]["code"]["description"]


def test_every_answer_of_the_engine_is_documented_with_its_code(schema):
    op = operation(schema, "/payments/", "post")
    engine_answers = (
        problems.KEY_MISSING, problems.KEY_INVALID, problems.BODY_INVALID,
        problems.LENGTH_REQUIRED, problems.PAYLOAD_MISMATCH, problems.IN_PROGRESS,
        problems.UNAVAILABLE,
    )  # fmt: skip
    for problem in engine_answers:
        assert f"`{problem.code}`" in op["responses"][str(problem.status)]["description"]


def test_the_key_is_optional_where_the_view_says_so(schema):
    assert header(operation(schema, "/optional/", "post"), "Idempotency-Key")["required"] is False


def test_only_the_methods_the_view_protects_get_the_key(schema):
    assert header(operation(schema, "/payments/", "get"), "Idempotency-Key") is None
    assert header(operation(schema, "/put/", "put"), "Idempotency-Key") is not None
    viewset = "/api/viewset-payments/{id}/"
    assert header(operation(schema, viewset, "patch"), "Idempotency-Key") is not None
    assert header(operation(schema, viewset, "put"), "Idempotency-Key") is None
    assert header(operation(schema, viewset, "get"), "Idempotency-Key") is None


@override_settings(ROOT_URLCONF="tests.testapp.misconfigured_urls")
def test_a_view_that_cannot_be_documented_is_reported_not_fatal():
    # MisconfiguredPaymentView's methods option is invalid: the schema is made without it.
    generated = SchemaGenerator().get_schema(request=None, public=True)
    assert header(operation(generated, "/misconfigured/", "post"), "Idempotency-Key") is None


@override_settings(IDEMPOTENCY={"HEADER": "X-Request-Key"})
def test_the_header_follows_the_setting():
    generated = SchemaGenerator().get_schema(request=None, public=True)
    op = operation(generated, "/payments/", "post")
    assert header(op, "X-Request-Key") is not None
    assert header(op, "Idempotency-Key") is None


def test_a_documented_400_keeps_its_description_and_gains_the_problem_type(schema):
    op = operation(schema, "/api/viewset-payments/", "post")
    assert op["responses"]["400"]["content"]["application/problem+json"]["schema"] == PROBLEM


def test_a_conditional_operation_documents_if_match_and_its_answers(schema):
    patch = operation(schema, "/documents/{id}/", "patch")
    assert header(patch, "If-Match")["required"] is False
    assert "428" not in patch["responses"]
    assert patch["responses"]["412"]["headers"]["ETag"]
    assert patch["responses"]["200"]["headers"]["ETag"]
    assert header(patch, "Idempotency-Key") is None  # conditional, not idempotent

    strict = operation(schema, "/documents/{id}/strict/", "patch")
    assert header(strict, "If-Match")["required"] is True
    assert strict["responses"]["428"]["content"]["application/problem+json"]["schema"] == PROBLEM

    get = operation(schema, "/documents/{id}/", "get")
    assert header(get, "If-None-Match")["required"] is False
    assert "304" in get["responses"]
    assert get["responses"]["200"]["headers"]["ETag"]


def test_both_mixins_document_both(schema):
    patch = operation(schema, "/documents/{id}/idempotent/", "patch")
    assert header(patch, "Idempotency-Key") is not None
    assert header(patch, "If-Match") is not None
    assert {"400", "409", "412", "422"} <= set(patch["responses"])


def test_the_key_publishes_its_format_and_lifetime(schema):
    key = header(operation(schema, "/payments/", "post"), "Idempotency-Key")
    assert key["schema"] == {
        "type": "string",
        "minLength": 1,
        "maxLength": 255,
        "pattern": "^[!-~]+$",
    }
    assert "visible ASCII" in key["description"]
    assert "kept for 24 hours after its first request" in key["description"]
    assert key["x-idempotency-key-ttl-seconds"] == 86400


@pytest.mark.parametrize("value", ["abc-123", "a b", "caf\u00e9", "tab\there", "~!#$%"])
def test_the_published_pattern_is_what_the_server_accepts(schema, value):
    pattern = header(operation(schema, "/payments/", "post"), "Idempotency-Key")["schema"][
        "pattern"
    ]
    try:
        parse_key(value)
    except InvalidKey:
        accepted = False
    else:
        accepted = True
    assert bool(re.fullmatch(pattern, value)) is accepted


@pytest.mark.parametrize(
    ("ttl", "said"),
    [
        (90 * 60, "90 minutes"),
        (60, "1 minute"),
        (45, "45 seconds"),
        (3600, "1 hour"),
        (timedelta(days=7), "7 days"),
        (timedelta(days=1, seconds=1), "86401 seconds"),
    ],
)
def test_the_lifetime_follows_the_ttl(ttl, said):
    with override_settings(IDEMPOTENCY={"TTL": ttl}):
        generated = SchemaGenerator().get_schema(request=None, public=True)
    key = header(operation(generated, "/payments/", "post"), "Idempotency-Key")
    assert f"kept for {said} after" in key["description"]
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    assert key["x-idempotency-key-ttl-seconds"] == seconds


class WeekLongKeys(IdempotentMixin, APIView):
    idempotency_ttl = timedelta(days=7)

    def post(self, request):
        return Response(status=201)


def test_the_lifetime_is_the_views_own():
    generated = SchemaGenerator(patterns=[path("week/", WeekLongKeys.as_view())]).get_schema(
        request=None, public=True
    )
    key = header(operation(generated, "/week/", "post"), "Idempotency-Key")
    assert key["x-idempotency-key-ttl-seconds"] == 7 * 86400


def test_the_retryable_answers_say_when_to_retry_with_the_same_key(schema):
    op = operation(schema, "/payments/", "post")
    for status in ("409", "503"):
        response = op["responses"][status]
        assert response["content"]["application/problem+json"]["schema"] == PROBLEM
        assert response["headers"]["Retry-After"]["schema"]["type"] == "integer"
        assert "same key" in response["description"]
    assert "idempotency.unavailable" in op["responses"]["503"]["description"]
    assert "new key" in op["responses"]["422"]["description"]
    assert "503" not in operation(schema, "/payments/", "get")["responses"]


def test_the_403_is_documented_only_when_anonymous_keys_are_rejected(schema):
    assert "403" not in operation(schema, "/payments/", "post")["responses"]
    with override_settings(IDEMPOTENCY={"ANONYMOUS": "reject"}):
        generated = SchemaGenerator().get_schema(request=None, public=True)
        validate_schema(generated)
    forbidden = operation(generated, "/payments/", "post")["responses"]["403"]
    assert "idempotency.anonymous_rejected" in forbidden["description"]
    assert forbidden["content"]["application/problem+json"]["schema"] == PROBLEM
    assert "403" not in operation(generated, "/payments/", "get")["responses"]
