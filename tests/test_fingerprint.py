from __future__ import annotations

import json
import sys

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import RequestFactory
from django.test.client import encode_multipart
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.conf import DEEPEST_JSON, DEFAULTS
from django_idempotency.core.fingerprint import UnreadableBody, canonical_json, request_fingerprint

factory = RequestFactory()
MAX_JSON_DEPTH = DEFAULTS["MAX_JSON_DEPTH"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, min_size=1, max_size=5)


def fingerprint_of(body: str | bytes, content_type="application/json", path="/p/?a=1", **extra):
    request = factory.post(path, body, content_type=content_type, **extra)
    return request_fingerprint(request, "p/")


@given(json_objects, st.randoms(use_true_random=False), st.integers(min_value=0, max_value=4))
def test_key_order_and_whitespace_do_not_change_the_fingerprint(data, random, indent):
    items = list(data.items())
    random.shuffle(items)
    reordered = json.dumps(dict(items), indent=indent or None, separators=None)
    assert fingerprint_of(json.dumps(data)) == fingerprint_of(reordered)


@given(json_objects, st.data())
def test_any_changed_value_changes_the_fingerprint(data, draw):
    name = draw.draw(st.sampled_from(sorted(data)))
    changed = {**data, name: draw.draw(json_values.filter(lambda value: value != data[name]))}
    # 1 and 1.0 and True are distinct JSON texts only where JSON itself distinguishes them.
    if canonical_json(json.dumps(changed).encode()) == canonical_json(json.dumps(data).encode()):
        return
    assert fingerprint_of(json.dumps(data)) != fingerprint_of(json.dumps(changed))


def test_method_route_query_and_named_headers_take_part():
    base = factory.post("/p/?a=1", b"x", content_type="text/plain", HTTP_X_TENANT="t1")
    reference = request_fingerprint(base, "p/", ["X-Tenant"])
    assert request_fingerprint(base, "q/", ["X-Tenant"]) != reference
    assert request_fingerprint(base, "p/") != reference
    other_query = factory.post("/p/?a=2", b"x", content_type="text/plain", HTTP_X_TENANT="t1")
    assert request_fingerprint(other_query, "p/", ["X-Tenant"]) != reference
    other_tenant = factory.post("/p/?a=1", b"x", content_type="text/plain", HTTP_X_TENANT="t2")
    assert request_fingerprint(other_tenant, "p/", ["x-tenant"]) != reference
    put = factory.put("/p/?a=1", b"x", content_type="text/plain", HTTP_X_TENANT="t1")
    assert request_fingerprint(put, "p/", ["X-Tenant"]) != reference


def test_non_json_bodies_are_hashed_as_bytes():
    assert fingerprint_of(b"a=1", "text/plain") != fingerprint_of(b"a=2", "text/plain")
    assert fingerprint_of(b"{ }", "text/plain") != fingerprint_of(b"{}", "text/plain")


def test_invalid_json_falls_back_to_bytes():
    assert canonical_json(b"{not json") is None
    assert fingerprint_of(b"{not json") != fingerprint_of(b"{not  json")


def test_json_with_integers_beyond_a_double_is_fingerprinted_as_json_too():
    # RFC 8785 cannot write them; the canonical form's fallback does, exactly.
    reference = fingerprint_of(b'{"n": 9007199254740993, "a": 1}')
    assert fingerprint_of(b'{"a":1,"n":9007199254740993}') == reference
    assert fingerprint_of(b'{"a":1,"n":9007199254740995}') != reference


def test_json_is_recognised_by_suffix():
    compact, spaced = b'{"a":1,"b":2}', b'{ "b": 2, "a": 1 }'
    kind = "application/merge-patch+json"
    assert fingerprint_of(compact, kind) == fingerprint_of(spaced, kind)


def test_multipart_is_hashed_by_fields_and_files_not_by_boundary():
    def upload(content: bytes, note: str, boundary: str):
        data = {"note": note, "file": SimpleUploadedFile("a.bin", content, "image/png")}
        encoded = encode_multipart(boundary, data)
        request = factory.post(
            "/u/", encoded, content_type=f"multipart/form-data; boundary={boundary}"
        )
        return request_fingerprint(request, "u/")

    assert upload(b"abc", "n", "one") == upload(b"abc", "n", "two")
    assert upload(b"abc", "n", "one") != upload(b"abd", "n", "one")
    assert upload(b"abc", "n", "one") != upload(b"abc", "m", "one")
    assert upload(b"", "n", "one") != upload(b"", "", "one")


def nested(depth: int) -> bytes:
    return b'{"a": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_json_up_to_the_depth_limit_is_fingerprinted_as_json():
    assert fingerprint_of(nested(MAX_JSON_DEPTH)) == fingerprint_of(
        nested(MAX_JSON_DEPTH).replace(b" ", b"")
    )


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 5000])
def test_json_nested_deeper_than_the_limit_cannot_be_fingerprinted(depth):
    with pytest.raises(UnreadableBody, match=f"deeper than {MAX_JSON_DEPTH} levels"):
        fingerprint_of(nested(depth))


@pytest.mark.parametrize(
    ("number", "named"),
    [
        ("NaN", "NaN"),
        ("Infinity", "Infinity"),
        ("-Infinity", "-Infinity"),
        ("1e400", "a number beyond the range of a double"),
        ("-1E+999", "a number beyond the range of a double"),
    ],
)
def test_json_with_nan_or_an_infinity_cannot_be_fingerprinted(number, named):
    # Python's json module reads them; RFC 8259 has no such numbers.
    with pytest.raises(UnreadableBody, match=f"^The JSON body holds {named}, which is not a JSON"):
        fingerprint_of(f'{{"a": [1, {{"b": {number}}}]}}')
    assert canonical_json(f'{{"a": {number}}}'.encode()) is None


def test_large_and_small_finite_numbers_are_fingerprinted_as_json():
    assert fingerprint_of('{"a": 1.7976931348623157e308, "b": 1e-400}') == fingerprint_of(
        '{"b":1e-400,"a":1.7976931348623157e308}'
    )


def test_the_names_of_the_constants_are_still_text():
    assert fingerprint_of('{"a": "NaN"}') == fingerprint_of('{ "a":"NaN" }')


@pytest.mark.parametrize("depth", [10, 64, DEEPEST_JSON])
def test_the_depth_limit_follows_the_setting(settings, depth):
    settings.IDEMPOTENCY = {"MAX_JSON_DEPTH": depth}

    assert fingerprint_of(nested(depth)) == fingerprint_of(nested(depth).replace(b" ", b""))
    with pytest.raises(UnreadableBody, match=f"deeper than {depth} levels"):
        fingerprint_of(nested(depth + 1))


def test_the_deepest_setting_leaves_room_on_the_stack():
    # The request's own frames come first: parsing and canonicalizing recurse once per level.
    assert sys.getrecursionlimit() // 4 >= DEEPEST_JSON
