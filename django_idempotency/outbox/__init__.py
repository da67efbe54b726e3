"""The transactional outbox: messages published in a transaction leave once it commits.

Call :func:`publish` in the transaction that makes the change, register a dispatcher per topic,
and schedule the periodic relay (or ``manage.py idempotency_outbox``).
"""

from __future__ import annotations

from django_idempotency.exceptions import PermanentError
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
    "PermanentError",
    "RelayResult",
    "WebhookDispatcher",
    "envelope",
    "outbox_dispatcher",
    "publish",
    "redeliver",
    "register_dispatcher",
    "relay",
]
