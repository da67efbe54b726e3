"""The transactional outbox: messages published in a transaction leave once it commits.

Call :func:`publish` in the transaction that makes the change, register a dispatcher per topic,
and schedule the periodic relay (or ``manage.py idempotency_outbox``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django_idempotency.core import deprecation
from django_idempotency.outbox.dispatchers import (
    ANY_TOPIC,
    CeleryTaskDispatcher,
    DispatchError,
    PermanentDispatchError,
    WebhookDispatcher,
    envelope,
    outbox_dispatcher,
    register_dispatcher,
)
from django_idempotency.outbox.relaying import RelayResult, publish, redeliver, relay

__all__ = [
    "ANY_TOPIC",
    "CeleryTaskDispatcher",
    "DispatchError",
    "PermanentDispatchError",
    "RelayResult",
    "WebhookDispatcher",
    "envelope",
    "outbox_dispatcher",
    "publish",
    "redeliver",
    "register_dispatcher",
    "relay",
]

if TYPE_CHECKING:
    from django_idempotency.exceptions import PermanentError  # noqa: F401 - deprecated here
else:
    # Its one home is django_idempotency.exceptions.
    __getattr__ = deprecation.moved(__name__, {"PermanentError": "django_idempotency.exceptions"})
