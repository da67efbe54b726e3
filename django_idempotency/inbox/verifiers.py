"""What a webhook receiver verifies deliveries with: any :class:`Verifier`.

The HMAC schemes the package ships live in :mod:`django_idempotency.signing`, which the outbox
signs with too; :mod:`django_idempotency.inbox` exports them with this protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping


@runtime_checkable
class Verifier(Protocol):
    """Anything that can tell whether a webhook delivery was signed by its sender."""

    def verify(self, headers: Mapping[str, str], body: bytes) -> None:
        """Raise SignatureError unless ``body`` was signed by the sender."""
