"""One canonical JSON form, and its SHA-256: how the library tells two payloads apart.

Request fingerprints, inbox payloads and task arguments are compared by it, so that key order,
whitespace and the spelling of a number (``1.0``, ``1``) do not count. The form is RFC 8785's
(JSON Canonicalization Scheme). RFC 8785 writes numbers as doubles, so it refuses integers beyond
2**53, which some senders use as ids, and it knows nothing of a task's dates or decimals. A value
holding any of those is written whole in the fallback form instead: JSON with sorted keys and no
whitespace, integers exact, dates, times, decimals and UUIDs as Django's JSON encoder writes them,
and any other object as its ``repr()``. Either way, equal values have equal forms.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import rfc8785
from django.core.serializers.json import DjangoJSONEncoder


def dumps(value: Any) -> bytes:
    """The canonical JSON of ``value``: RFC 8785's where it can represent it, else the fallback."""
    try:
        return rfc8785.dumps(value)
    except (TypeError, ValueError, rfc8785.CanonicalizationError):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), cls=_Encoder).encode()


def sha256(value: Any) -> str:
    """The SHA-256 of ``value``'s canonical JSON, in hex."""
    return hashlib.sha256(dumps(value)).hexdigest()


class _Encoder(DjangoJSONEncoder):
    def default(self, o: Any) -> Any:
        try:
            return super().default(o)
        except TypeError:
            return repr(o)
