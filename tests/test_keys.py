from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.keys import InvalidKey, parse_key

visible = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255)


@given(visible.filter(lambda key: not key.startswith('"') and "," not in key))
def test_any_visible_ascii_token_without_a_comma_is_its_own_key(key):
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


# A header sent twice reaches the view as one value joined by a comma (RFC 9110 section 5.3):
# every list shape is refused, whatever its members look like.
@pytest.mark.parametrize(
    "value",
    [
        "k,k",
        "a,b",
        "k,",
        ",k",
        ",",
        '"a", "b"',
        '"a","b"',
        '"a",b',
        'a,"b"',
        '"k","k"',
    ],
)
def test_a_list_of_keys_is_refused(value):
    with pytest.raises(InvalidKey, match="more than one key"):
        parse_key(value)


def test_a_quoted_key_may_hold_a_comma():
    assert parse_key('"a,b"') == "a,b"
    assert parse_key('","') == ","
