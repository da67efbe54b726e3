"""One contract, two schemas: DRF's (drf-spectacular) and Ninja's document the same answers."""

from __future__ import annotations

import re

import pytest
from django.test import override_settings
from drf_spectacular.generators import SchemaGenerator
from ninja import NinjaAPI, Status

from django_idempotency.ninja import idempotent

PROBLEM_MEDIA_TYPE = "application/problem+json"

api = NinjaAPI(urls_namespace="contract")


@api.post("/payments/", response={201: dict})
@idempotent()
def create_payment(request):
    return Status(201, {})


def drf_operation():
    """``POST /payments/`` of the test app: a DRF view with ``IdempotentMixin``."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    operation = schema["paths"]["/payments/"]["post"]
    return operation, schema["components"]["schemas"]["IdempotencyProblem"]


def ninja_operation():
    """The same operation through ``django_idempotency.ninja``."""
    operation = api.get_openapi_schema(path_prefix="/")["paths"]["/payments/"]["post"]
    responses = {str(status): response for status, response in operation["responses"].items()}
    problem = next(
        response["content"][PROBLEM_MEDIA_TYPE]["schema"]
        for response in responses.values()
        if PROBLEM_MEDIA_TYPE in response.get("content", {})
    )
    return {**operation, "responses": responses}, problem


def key_parameter(operation):
    [parameter] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    return parameter


def problem_answers(operation):
    """Each problem answer's status: its codes, description and headers."""
    return {
        status: {
            "codes": re.findall(r"`(idempotency\.[a-z_]+)`", response["description"]),
            "description": response["description"],
            "headers": response.get("headers", {}),
        }
        for status, response in operation["responses"].items()
        if PROBLEM_MEDIA_TYPE in response.get("content", {})
    }


def success_headers(operation):
    """The headers of its success answers (the two views answer 201 and 200: no matter)."""
    headers = [
        response.get("headers", {})
        for status, response in operation["responses"].items()
        if status.startswith("2")
    ]
    assert headers
    return headers


@pytest.mark.parametrize(
    "settings",
    [{}, {"ANONYMOUS": "reject", "TTL": 5400}, {"KEY_REQUIRED": False}],
)
def test_drf_and_ninja_document_the_same_contract(settings):
    with override_settings(IDEMPOTENCY=settings):
        drf, drf_problem = drf_operation()
        ninja, ninja_problem = ninja_operation()

    assert key_parameter(ninja) == key_parameter(drf)
    assert success_headers(ninja) == success_headers(drf)
    drf_answers, ninja_answers = problem_answers(drf), problem_answers(ninja)
    assert {status: a["codes"] for status, a in ninja_answers.items()} == {
        status: a["codes"] for status, a in drf_answers.items()
    }
    assert {status: a["headers"] for status, a in ninja_answers.items()} == {
        status: a["headers"] for status, a in drf_answers.items()
    }
    for status, answer in drf_answers.items():
        # Ninja may add a word on how it answers the same status itself (its own 422).
        assert ninja_answers[status]["description"].startswith(answer["description"])
    # One problem body: Ninja's schema lists the codes in an enum too, drf-spectacular's cannot.
    ninja_code = dict(ninja_problem["properties"]["code"])
    assert ninja_code.pop("enum") == sorted(
        re.findall(r"[a-z]+\.[a-z_]+", drf_problem["properties"]["code"]["description"])
    )
    assert {**ninja_problem, "properties": {**ninja_problem["properties"], "code": ninja_code}} == {
        **drf_problem,
        "title": "IdempotencyProblem",
    }
