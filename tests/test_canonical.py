"""The one canonical JSON form by which fingerprints, inbox payloads and task arguments compare."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import uuid

import pytest

from django_idempotency.core import canonical

BEYOND_A_DOUBLE = 2**53 + 1  # the first integer a double cannot hold


def test_key_order_whitespace_and_the_spelling_of_a_number_do_not_count():
    form = canonical.dumps({"b": [1.0, "é"], "a": 1e2})
    assert form == canonical.dumps({"a": 100, "b": [1, "é"]})
    assert form == '{"a":100,"b":[1,"é"]}'.encode()


def test_its_hash_is_the_sha256_of_the_form():
    value = {"id": "evt_1"}
    assert canonical.sha256(value) == hashlib.sha256(b'{"id":"evt_1"}').hexdigest()


@pytest.mark.parametrize("large", [BEYOND_A_DOUBLE, -BEYOND_A_DOUBLE, 2**64])
def test_integers_beyond_a_double_are_kept_exact_and_key_order_still_does_not_count(large):
    form = canonical.dumps({"b": 1, "id": large})
    assert form == f'{{"b":1,"id":{large}}}'.encode()
    assert canonical.dumps({"id": large, "b": 1}) == form
    assert canonical.dumps({"b": 1, "id": large + 1}) != form


def test_values_that_are_not_json_are_written_as_django_writes_them():
    day, amount, token = datetime.date(2026, 11, 27), decimal.Decimal("10.50"), uuid.UUID(int=1)
    assert canonical.dumps([day, amount, token]) == (
        b'["2026-11-27","10.50","00000000-0000-0000-0000-000000000001"]'
    )


def test_any_other_object_is_written_as_its_repr():
    class Point:
        def __repr__(self) -> str:
            return "Point(1, 2)"

    assert canonical.dumps({"at": Point()}) == b'{"at":"Point(1, 2)"}'
