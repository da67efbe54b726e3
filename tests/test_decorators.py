"""The HTTP contract through ``@idempotent`` on plain Django views."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import override_settings
from django.test.client import encode_multipart

from django_idempotency.models import IdempotencyKey
from tests.conftest import ApiClient
from tests.testapp.models import LedgerEntry, Payment

pytestmark = pytest.mark.django_db


@pytest.fixture
def client():
    return ApiClient()


def test_function_view_stores_and_replays(client, key):
    first = client.send("POST", "/plain/", {"amount": 10}, key=key)
    second = client.send("POST", "/plain/", {"amount": 10}, key=key)
    assert first.status_code == second.status_code == 201
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert second["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert Payment.objects.count() == LedgerEntry.objects.count() == 1


def test_function_view_mismatch_and_missing_key(client, key):
    client.send("POST", "/plain/", {"amount": 10}, key=key)
    assert client.send("POST", "/plain/", {"amount": 11}, key=key).status_code == 422
    missing = client.send("POST", "/plain/", {"amount": 10})
    assert missing.status_code == 400
    assert json.loads(missing.content)["code"] == "idempotency.key_missing"


def test_safe_methods_pass_through(client, key):
    response = client.send("GET", "/plain/", key=key)
    assert response.status_code == 200
    assert IdempotencyKey.objects.count() == 0


def test_a_5xx_is_rolled_back_and_the_key_released(client, key):
    failed = client.send("POST", "/plain/", {"amount": 1}, key=key, headers={"X-Status": "500"})
    assert failed.status_code == 500
    assert (Payment.objects.count(), IdempotencyKey.objects.count()) == (0, 0)
    assert client.send("POST", "/plain/", {"amount": 1}, key=key).status_code == 201


@pytest.mark.parametrize("status", [400, 422])
def test_a_plain_views_invalid_request_answer_is_not_kept(client, key, status):
    rejected = {"X-Status": str(status)}
    answer = client.send("POST", "/plain/", {"amount": 1}, key=key, headers=rejected)
    assert answer.status_code == status
    assert "Idempotency-Status" not in answer
    assert (Payment.objects.count(), IdempotencyKey.objects.count()) == (0, 0)
    corrected = client.send("POST", "/plain/", {"amount": 1}, key=key)
    assert corrected["Idempotency-Status"] == "stored"


def test_options_given_to_the_decorator(client, key):
    client.send("POST", "/plain-optional/", {"amount": 1})
    assert IdempotencyKey.objects.count() == 0
    client.send("POST", "/plain-optional/", {"amount": 1}, key=key)
    row = IdempotencyKey.objects.get()
    assert (row.expires_at - row.created_at).total_seconds() == 60


def test_class_based_view_with_method_decorator(client, key):
    tenant_a = {"X-Tenant": "a"}
    client.send("POST", "/class-based/", {"amount": 1}, key=key, headers=tenant_a)
    replay = client.send("POST", "/class-based/", {"amount": 1}, key=key, headers=tenant_a)
    other = client.send("POST", "/class-based/", {"amount": 1}, key=key, headers={"X-Tenant": "b"})
    assert replay["Idempotency-Status"] == "replayed"
    assert other.status_code == 422
    assert Payment.objects.count() == 1


def test_a_template_response_is_rendered_before_it_is_stored(client, key):
    first = client.send("POST", "/template/", {}, key=key)
    second = client.send("POST", "/template/", {}, key=key)
    assert first.content == second.content == b"payment 3"
    assert Payment.objects.count() == 1


def test_a_streaming_response_is_stored_whole(client, key):
    first = client.send("POST", "/streaming/", {}, key=key)
    second = client.send("POST", "/streaming/", {}, key=key)
    assert b"".join(first.streaming_content) == b"chunk-1,chunk-2"
    assert second.content == b"chunk-1,chunk-2"
    assert Payment.objects.count() == 1


def test_an_empty_204_replays_without_a_content_type(client, key):
    client.send("POST", "/empty/", {}, key=key)
    second = client.send("POST", "/empty/", {}, key=key)
    assert second.status_code == 204
    assert second.content == b""
    assert "Content-Type" not in second


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=2_621_440, FILE_UPLOAD_MAX_MEMORY_SIZE=2_621_440)
def test_a_3mb_multipart_upload_behaves_the_same_with_a_key(client, key):
    content = bytes(range(256)) * (3 * 1024 * 1024 // 256)

    def post(boundary, idempotency_key=None):
        body = encode_multipart(boundary, {"note": "scan", "file": _upload(content)})
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return client.post(
            "/upload/",
            body,
            content_type=f"multipart/form-data; boundary={boundary}",
            headers=headers,
        )

    first = post("boundary-one", key)
    # A retrying client draws a new multipart boundary: still the same request.
    retry = post("boundary-two", key)
    assert first.status_code == retry.status_code == 201
    assert json.loads(first.content)["size"] == len(content)
    assert retry["Idempotency-Status"] == "replayed"
    assert Payment.objects.count() == 1


def _upload(content):
    return SimpleUploadedFile("scan.bin", content, "application/octet-stream")


def test_a_multipart_patch_is_fingerprinted_by_its_fields_and_files(client, key):
    def patch(note, boundary):
        body = encode_multipart(boundary, {"note": note, "file": _upload(b"x" * 1000)})
        return client.generic(
            "PATCH",
            "/upload/",
            body,
            content_type=f"multipart/form-data; boundary={boundary}",
            headers={"Idempotency-Key": key},
        )

    first = patch("one", "b1")
    retry = patch("one", "b2")
    changed = patch("two", "b3")
    assert first.status_code == 201
    assert json.loads(first.content)["size"] == 1000
    assert json.loads(first.content)["note"] == "one"
    assert retry["Idempotency-Status"] == "replayed"
    assert changed.status_code == 422


def test_decorated_twice_claims_once(client, key):
    first = client.send("POST", "/twice/", {"amount": 1}, key=key)
    second = client.send("POST", "/twice/", {"amount": 1}, key=key)
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert Payment.objects.count() == IdempotencyKey.objects.count() == 1


def test_a_misspelt_option_is_refused_where_the_view_is_decorated():
    from django_idempotency.decorators import idempotent  # noqa: PLC0415

    with pytest.raises(TypeError, match="ttl_seconds"):
        idempotent(ttl_seconds=60)
