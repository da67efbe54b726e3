"""The webhook inbox: every delivered event recorded once and processed once.

Subclass :class:`WebhookReceiverView` for each sender, register handlers with
:func:`inbox_handler`, and schedule the periodic tasks (or ``manage.py idempotency_inbox``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django_idempotency.core import deprecation
from django_idempotency.inbox.handlers import ANY_TYPE, inbox_handler, register_handler
from django_idempotency.inbox.processing import (
    ProcessResult,
    dispatch_due,
    mark_dead,
    process,
    reprocess,
    retry_now,
)
from django_idempotency.inbox.receiving import Receipt, receive
from django_idempotency.inbox.verifiers import Verifier
from django_idempotency.inbox.views import WebhookReceiverView

__all__ = [
    "ANY_TYPE",
    "ProcessResult",
    "Receipt",
    "Verifier",
    "WebhookReceiverView",
    "dispatch_due",
    "inbox_handler",
    "mark_dead",
    "process",
    "receive",
    "register_handler",
    "reprocess",
    "retry_now",
]

# Deprecated here: each name's one home is the module it maps to.
_MOVED = {
    "PermanentError": "django_idempotency.exceptions",
    "GitHubSignature": "django_idempotency.signing",
    "HMACVerifier": "django_idempotency.signing",
    "SignatureError": "django_idempotency.signing",
    "StandardWebhooksSignature": "django_idempotency.signing",
    "StripeSignature": "django_idempotency.signing",
}

if TYPE_CHECKING:
    from django_idempotency.exceptions import PermanentError  # noqa: F401
    from django_idempotency.signing import (  # noqa: F401
        GitHubSignature,
        HMACVerifier,
        SignatureError,
        StandardWebhooksSignature,
        StripeSignature,
    )
else:
    __getattr__ = deprecation.moved(__name__, _MOVED)
