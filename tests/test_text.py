"""Text that every database stores (``core/text.py``)."""

from __future__ import annotations

import pytest

from django_idempotency.core.text import mended, storable
from django_idempotency.queue.schedule import error_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [("payment", True), ("é ✓ 💳", True), ("a\x00b", False), ("\ud800", False), ("x\udfff", False)],
)
def test_storable_text_has_no_nul_and_no_lone_surrogate(text, expected):
    assert storable(text) is expected


def test_mended_text_replaces_what_no_database_takes():
    assert mended("a\x00b\ud800c 💳") == "a\ufffdb\ufffdc 💳"
    assert storable(mended("\x00\udbff"))


def test_an_errors_text_is_mended_before_a_row_keeps_it():
    assert error_text(ValueError("bad \x00 byte \udc80")) == "ValueError: bad \ufffd byte \ufffd"
