"""The ``Idempotency-Key`` request header, and the key the library hands to the code it runs."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from django_idempotency.conf import idempotency_settings

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = [
    "InvalidKey",
    "ScopedKey",
    "downstream_key",
    "key_of",
]

MAX_LENGTH = 255

# Visible ASCII (RFC 5234 VCHAR): no spaces, no control characters, nothing beyond 0x7E.
_VCHARS = re.compile(r"[\x21-\x7e]+")
# A structured-field string (RFC 8941 section 3.3.3) whose characters are all visible ASCII:
# a backslash escapes only a quote or a backslash.
_SF_STRING = re.compile(r'"((?:[\x21\x23-\x5b\x5d-\x7e]|\\["\\])+)"')
_SF_ESCAPE = re.compile(r'\\(["\\])')
# Any quoted string, well-formed or not: what is left once they are removed is outside quotes.
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


class InvalidKey(ValueError):
    """The header is present but is not a usable key."""


def parse_key(value: str) -> str:
    """Return the key carried by a header value, bare (``abc``) or quoted (``"abc"``)."""
    # The draft makes the header one sf-string, not a list. A header sent twice reaches the
    # application as one value, its lines joined by a comma (RFC 9110 section 5.3): "k,k" is two
    # keys, not a new one. So a bare key may not hold a comma; a quoted one may.
    if value.startswith('"'):
        match = _SF_STRING.fullmatch(value)
        if match is None:
            if "," in _QUOTED.sub("", value):
                raise InvalidKey(_LIST)
            msg = "the quoted key is not a valid string of visible ASCII characters"
            raise InvalidKey(msg)
        key = _SF_ESCAPE.sub(r"\1", match.group(1))
    elif "," in value:
        raise InvalidKey(_LIST)
    elif _VCHARS.fullmatch(value):
        key = value
    elif not value:
        msg = "the key is empty"
        raise InvalidKey(msg)
    else:
        msg = "the key has characters outside visible ASCII"
        raise InvalidKey(msg)
    if len(key) > MAX_LENGTH:
        msg = f"the key is longer than {MAX_LENGTH} characters"
        raise InvalidKey(msg)
    return key


_LIST = (
    "it holds more than one key (a comma outside quotes separates keys, as when the header is "
    "sent twice); send one key, and quote it if it contains a comma"
)


class ScopedKey(str):
    """A key as the library claimed it: its canonical form (a ``str``), within its scope.

    ``Idempotency-Key: K`` and ``Idempotency-Key: "K"`` are one key; this is ``K``. Give a
    downstream service (a payment provider) ``downstream_key``, never the raw header: it is the
    same for every spelling of the key, and differs between two scopes' equal keys (and between
    two projects' with the ``DOWNSTREAM_KEY_NAMESPACE`` setting).
    """

    scope: str

    def __new__(cls, key: str, scope: str) -> ScopedKey:
        scoped = super().__new__(cls, key)
        scoped.scope = scope
        return scoped

    def __reduce__(self) -> tuple[type[ScopedKey], tuple[str, str]]:
        return ScopedKey, (str(self), self.scope)

    @property
    def downstream_key(self) -> str:
        return downstream_key(self.scope, self)


def downstream_key(scope: str, key: str, *, namespace: str | None = None) -> str:
    """The key to give a downstream service for ``key`` in ``scope``: 64 hex digits.

    SHA-256 of the JSON array ``[namespace, scope, key]``, the namespace being the
    ``DOWNSTREAM_KEY_NAMESPACE`` setting unless given; without one, of ``[scope, key]``. Stable
    across processes, releases and secret rotations (a provider remembers it for a day or
    more), it shows the provider neither the scope (a user's id, a route) nor the key.
    """
    if namespace is None:
        namespace = idempotency_settings.DOWNSTREAM_KEY_NAMESPACE
    # Without a namespace, the two-item form of 1.0: keys handed to a provider before an upgrade
    # stay the same. With one, three items: no namespaced key can be an un-namespaced one.
    parts = [namespace, scope, str(key)] if namespace else [scope, str(key)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def key_of(request: HttpRequest | Any) -> ScopedKey | None:
    """The key the library handles ``request`` under, or ``None`` if it handles no key.

    ``None`` for a safe method, a request without a key where the key is optional, or with the
    ``ENABLED`` setting off. ``request`` is Django's request or Django REST framework's.
    """
    return getattr(request, REQUEST_ATTRIBUTE, None)


# Where the engine leaves the key on Django's request; DRF's Request reads through to it.
REQUEST_ATTRIBUTE = "_idempotency_key"
