"""What the payments API takes in its free-form fields: what every supported database stores.

The DRF serializers and the Ninja schemas check with these functions, so that the two APIs refuse
the same input (DRF with a 400, Ninja with a 422) where a database would otherwise refuse the
write with a 500.
"""

from __future__ import annotations

from typing import Any


def text_problem(text: str) -> str | None:
    """Why a database cannot store ``text``, or ``None`` if it can."""
    # PostgreSQL holds no NUL character, in a text column or in jsonb; JSON and Python strings do.
    if "\x00" in text:
        return "Must not hold NUL characters."
    # JSON's "\ud800" reads as a lone surrogate, which is not UTF-8: no database stores it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "Must not hold lone surrogates."
    return None


def metadata_problem(value: Any) -> str | None:
    """Why a database cannot store the JSON ``value``, or ``None`` if it can."""
    # With a stack of its own: the walk must not recurse through what a client nested.
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and (problem := text_problem(node)) is not None:
            return problem
    return None
