"""Webhook signatures: sign deliveries, and check that a delivery came from its sender.

Ships the Standard Webhooks, Stripe and GitHub schemes, each with secret rotation. The inbox
verifies with them and the outbox signs with them. This module imports without Django settings,
so that a plain script can sign the webhooks it sends (a test sender, a load test).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.conf import as_timedelta

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from datetime import timedelta

    Secret = str | bytes
    Secrets = Secret | Sequence[Secret]

__all__ = [
    "GitHubSignature",
    "HMACVerifier",
    "SignatureError",
    "StandardWebhooksSignature",
    "StripeSignature",
]

_MISSING = "inbox.signature_missing"
_INVALID = "inbox.signature_invalid"
_EXPIRED = "inbox.signature_expired"

# Unix seconds as plain ASCII digits (int() alone would also take "+1", " 1", "1_0" and other
# scripts' digits); 18 digits is far past any real time and well inside int()'s string limit.
_TIMESTAMP = re.compile(r"[0-9]{1,18}")


class SignatureError(Exception):
    """The request's signature is missing, malformed, wrong or outside the tolerance window."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # Django's request.headers ignores case already; a plain dict needs the scan.
    value = headers.get(name)
    if value is not None:
        return value
    wanted = name.lower()
    for key, candidate in headers.items():
        if key.lower() == wanted:
            return candidate
    return None


def _required(headers: Mapping[str, str], name: str) -> str:
    value = _header(headers, name)
    if value is None:
        raise SignatureError(_MISSING, f"The {name} header is missing.")
    return value


def _malformed(name: str) -> SignatureError:
    return SignatureError(_INVALID, f"The {name} header is malformed.")


def _timestamp(value: str, name: str) -> int:
    if _TIMESTAMP.fullmatch(value) is None:
        raise _malformed(name)
    return int(value)


def _unhex(value: str, name: str) -> bytes:
    try:
        return binascii.unhexlify(value)
    except ValueError:  # binascii.Error is a ValueError, as is a non-ASCII str
        raise _malformed(name) from None


def _hmac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


class HMACVerifier(ABC):
    """Verify and produce HMAC-SHA256 webhook signatures, accepting any of several secrets.

    Pass one secret, several (during a rotation any may match; the first signs), or a
    zero-argument callable that returns either, read again at every call.
    """

    def __init__(
        self,
        secrets: Secrets | Callable[[], Secrets],
        *,
        tolerance: float | timedelta = 300,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._secrets = secrets
        name = type(self).__name__
        self._tolerance = as_timedelta(tolerance, f"{name} tolerance").total_seconds()
        self._clock = clock

    def verify(self, headers: Mapping[str, str], body: bytes) -> None:
        """Raise SignatureError unless ``body`` was signed with one of the secrets."""
        keys = self._keys()
        message, candidates, timestamp = self._parse(headers, body)
        matched = False
        # Every candidate against every key, without stopping early, so that the time taken
        # does not tell which secret or which signature entry matched.
        for key in keys:
            expected = _hmac(key, message)
            for candidate in candidates:
                matched |= hmac.compare_digest(expected, candidate)
        if not matched:
            raise SignatureError(_INVALID, "The signature does not match the request body.")
        # Only an authentic timestamp can be stale; a forged one already failed above.
        if timestamp is not None:
            now = self._clock()
            if not now - self._tolerance <= timestamp <= now + self._tolerance:
                raise SignatureError(
                    _EXPIRED, "The signature's timestamp is outside the tolerance window."
                )

    @abstractmethod
    def sign(self, body: bytes, *args: Any, **kwargs: Any) -> dict[str, str]:
        """Return the headers a sender sends with ``body``, signed with the first secret."""

    @abstractmethod
    def _parse(
        self, headers: Mapping[str, str], body: bytes
    ) -> tuple[bytes, list[bytes], int | None]:
        """Return the signed message, the candidate digests and the signed timestamp, if any."""

    def _key(self, secret: Secret) -> bytes:
        return secret.encode() if isinstance(secret, str) else secret

    def _keys(self) -> list[bytes]:
        name = type(self).__name__
        secrets = self._secrets() if callable(self._secrets) else self._secrets
        if isinstance(secrets, str | bytes):
            secrets = [secrets]
        if not secrets:
            msg = f"{name} has no secrets: give it a secret, a list of secrets, or a callable."
            raise ImproperlyConfigured(msg)
        if not all(secrets):
            msg = f"{name} was given an empty secret."
            raise ImproperlyConfigured(msg)
        return [self._key(secret) for secret in secrets]

    def _now(self, timestamp: int | None) -> int:
        return int(self._clock()) if timestamp is None else timestamp


class StandardWebhooksSignature(HMACVerifier):
    """Verify the Standard Webhooks scheme (standardwebhooks.com): ``webhook-*`` headers.

    A ``str`` secret that starts with ``whsec_`` is base64 after the prefix; any other ``str``
    is used as its UTF-8 bytes, and ``bytes`` as they are.
    """

    ID = "webhook-id"
    TIMESTAMP = "webhook-timestamp"
    SIGNATURE = "webhook-signature"

    def sign(self, body: bytes, *, msg_id: str, timestamp: int | None = None) -> dict[str, str]:
        """Return the three ``webhook-*`` headers for ``body``, signed with the first secret."""
        timestamp = self._now(timestamp)
        digest = _hmac(self._keys()[0], self._message(msg_id, timestamp, body))
        return {
            self.ID: msg_id,
            self.TIMESTAMP: str(timestamp),
            self.SIGNATURE: "v1," + base64.b64encode(digest).decode(),
        }

    def _key(self, secret: Secret) -> bytes:
        # The spec's secrets are "whsec_" + base64 of the key bytes.
        if isinstance(secret, str) and secret.startswith("whsec_"):
            try:
                return base64.b64decode(secret.removeprefix("whsec_"), validate=True)
            except ValueError:
                msg = f"{type(self).__name__}: a whsec_ secret must be base64 after the prefix."
                raise ImproperlyConfigured(msg) from None
        return super()._key(secret)

    def _message(self, msg_id: str, timestamp: int, body: bytes) -> bytes:
        # The spec signs "{id}.{timestamp}.{body}".
        return f"{msg_id}.{timestamp}.".encode() + body

    def _parse(
        self, headers: Mapping[str, str], body: bytes
    ) -> tuple[bytes, list[bytes], int | None]:
        msg_id = _required(headers, self.ID)
        raw_timestamp = _required(headers, self.TIMESTAMP)
        signature = _required(headers, self.SIGNATURE)
        timestamp = _timestamp(raw_timestamp, self.TIMESTAMP)
        candidates = []
        # A space-separated list of "version,signature"; only v1 (HMAC-SHA256) is symmetric, so
        # other versions, such as v1a (ed25519), are left to other verifiers.
        for entry in signature.split(" "):
            version, _, value = entry.partition(",")
            if version == "v1":
                try:
                    candidates.append(base64.b64decode(value, validate=True))
                except ValueError:
                    raise _malformed(self.SIGNATURE) from None
        if not candidates:
            raise _malformed(self.SIGNATURE)
        return self._message(msg_id, timestamp, body), candidates, timestamp


class StripeSignature(HMACVerifier):
    """Verify Stripe's ``Stripe-Signature: t=<unix>,v1=<hex>,...`` header."""

    HEADER = "Stripe-Signature"

    def sign(self, body: bytes, *, timestamp: int | None = None) -> dict[str, str]:
        """Return the ``Stripe-Signature`` header for ``body``, signed with the first secret."""
        timestamp = self._now(timestamp)
        digest = _hmac(self._keys()[0], self._message(timestamp, body))
        return {self.HEADER: f"t={timestamp},v1={digest.hex()}"}

    def _message(self, timestamp: int, body: bytes) -> bytes:
        # Stripe signs "{t}.{body}" and sends the hex digest as v1.
        return f"{timestamp}.".encode() + body

    def _parse(
        self, headers: Mapping[str, str], body: bytes
    ) -> tuple[bytes, list[bytes], int | None]:
        header = _required(headers, self.HEADER)
        timestamps = []
        candidates = []
        # During a Stripe secret roll the header carries one v1 per active secret; v0 and
        # unknown keys are ignored, as Stripe's own libraries do.
        for item in header.split(","):
            key, _, value = item.partition("=")
            key = key.strip()
            if key == "t":
                timestamps.append(_timestamp(value.strip(), self.HEADER))
            elif key == "v1":
                candidates.append(_unhex(value.strip(), self.HEADER))
        # Two t= entries would leave which one was signed to the reader; refuse rather than pick.
        if len(timestamps) != 1 or not candidates:
            raise _malformed(self.HEADER)
        timestamp = timestamps[0]
        return self._message(timestamp, body), candidates, timestamp


class GitHubSignature(HMACVerifier):
    """Verify GitHub's ``X-Hub-Signature-256: sha256=<hex>`` header.

    GitHub signs no timestamp, so there is no tolerance window: replay protection comes from
    the inbox's dedupe on the ``X-GitHub-Delivery`` id.
    """

    HEADER = "X-Hub-Signature-256"

    def __init__(self, secrets: Secrets | Callable[[], Secrets]) -> None:
        super().__init__(secrets)

    def sign(self, body: bytes) -> dict[str, str]:
        """Return the ``X-Hub-Signature-256`` header for ``body``, signed with the first secret."""
        return {self.HEADER: "sha256=" + _hmac(self._keys()[0], body).hex()}

    def _parse(
        self, headers: Mapping[str, str], body: bytes
    ) -> tuple[bytes, list[bytes], int | None]:
        header = _required(headers, self.HEADER)
        algorithm, separator, value = header.partition("=")
        if algorithm != "sha256" or not separator:
            raise _malformed(self.HEADER)
        return body, [_unhex(value, self.HEADER)], None
