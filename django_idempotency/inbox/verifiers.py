"""What a webhook receiver verifies deliveries with: any :class:`Verifier`.

The HMAC schemes it ships live in :mod:`django_idempotency.signing`, which the outbox signs with
too; they are exported here as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from django_idempotency.signing import (
    GitHubSignature,
    HMACVerifier,
    SignatureError,
    StandardWebhooksSignature,
    StripeSignature,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "GitHubSignature",
    "HMACVerifier",
    "SignatureError",
    "StandardWebhooksSignature",
    "StripeSignature",
    "Verifier",
]


@runtime_checkable
class Verifier(Protocol):
    """Anything that can tell whether a webhook delivery was signed by its sender."""

    def verify(self, headers: Mapping[str, str], body: bytes) -> None:
        """Raise SignatureError unless ``body`` was signed by the sender."""
