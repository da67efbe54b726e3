from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.keys import InvalidKey, parse_key

visible = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255)


@given(visible.filter(lambda key: not key.startswith('"')))
def test_any_visible_ascii_token_is_its_own_key(key):
    assert parse_key(key) == key


@given(visible)
def test_the_quoted_form_carries_the_same_key(key):
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    assert parse_key(f'"{escaped}"') == key


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty"),
        (" ", "outside visible ASCII"),
        ("a b", "outside visible ASCII"),
        ("\u00e9", "outside visible ASCII"),
        ("\x00", "outside visible ASCII"),
        ("x" * 256, "longer than 255"),
        ('"x', "not a valid string"),
        ('"a"b"', "not a valid string"),
        ('"\\n"', "not a valid string"),
        ('"a b"', "not a valid string"),
        ('""', "not a valid string"),
    ],
)
def test_bad_keys_say_why(value, reason):
    with pytest.raises(InvalidKey, match=reason):
        parse_key(value)
