"""Text that every database stores.

PostgreSQL refuses a NUL character in text and in JSON, and a lone surrogate (what Python makes
of JSON's ``"\\ud800"``, or of bytes decoded with ``surrogatepass``) is not Unicode that UTF-8 can
encode. Values from outside (a webhook's id, a broker message's properties, an exception's
message) are checked, or mended, before they reach a column.
"""

from __future__ import annotations

import re

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str) -> bool:
    """Whether every database takes ``text``: no NUL character, no lone surrogate."""
    return _UNSTORABLE.search(text) is None


def mended(text: str) -> str:
    """``text`` with what no database takes (NUL, lone surrogates) replaced by U+FFFD."""
    return _UNSTORABLE.sub("\ufffd", text)
