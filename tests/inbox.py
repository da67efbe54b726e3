"""Signed deliveries to the test app's webhook receivers."""

from __future__ import annotations

import json
import uuid

from django.conf import settings
from django.test import Client

from django_idempotency.signing import StandardWebhooksSignature


def refund_event(event_id=None, amount=500, **data):
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex}",
        "type": "refund.succeeded",
        "data": {"amount": amount, **data},
    }


def deliver(payload, *, path="/webhooks/tests/", signer=None, client=None, headers=None):
    """POST ``payload`` signed the way the test receiver checks; return the response."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    signer = signer or StandardWebhooksSignature(settings.TEST_WEBHOOK_SECRETS)
    signed = signer.sign(body, msg_id=f"msg_{uuid.uuid4().hex}")
    return (client or Client()).post(
        path, body, content_type="application/json", headers={**signed, **(headers or {})}
    )
