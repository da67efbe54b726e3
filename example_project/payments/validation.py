"""What the payments API takes in its free-form fields: what every supported database stores.

The DRF serializers and the Ninja schemas check with these functions, so that the two APIs refuse
the same input (DRF with a 400, Ninja with a 422) where a database would otherwise refuse the
write with a 500.
"""

from __future__ import annotations

import json
from typing import Any

# A payment's metadata is a few labels, as Stripe's is: nothing comes near these bounds. They keep
# it far inside what every database stores (MariaDB's JSON columns refuse 32 levels) whatever the
# library's MAX_JSON_DEPTH lets through, and keep each payment row small.
METADATA_MAX_DEPTH = 8  # {} is 1 level, {"a": []} 2
METADATA_MAX_SIZE = 8 * 1024  # characters of its JSON


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
    """Why the JSON ``value`` is not metadata the payments API keeps, or ``None`` if it is."""
    # With a stack of its own: the walk must not recurse through what a client nested.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list) and depth > METADATA_MAX_DEPTH:
            return f"Must be nested at most {METADATA_MAX_DEPTH} levels deep."
        if isinstance(node, dict):
            stack.extend((key, depth) for key in node)
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
        elif isinstance(node, str) and (problem := text_problem(node)) is not None:
            return problem
    if len(json.dumps(value, ensure_ascii=False)) > METADATA_MAX_SIZE:
        return f"Must be at most {METADATA_MAX_SIZE} characters of JSON."
    return None
