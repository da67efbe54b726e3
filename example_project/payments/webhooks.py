"""Webhooks: the provider's, and our own payment events, received into the inbox and handled once.

Our payment events leave through the outbox (see views.record_capture) and come back here, as
they would reach another service of ours: over HTTP, or through a message broker when
PAYMENT_EVENTS_BROKER_URL is set (consumed by ``manage.py idempotency_consume``).
"""

from __future__ import annotations

import os
import time

from django.conf import settings

from django_idempotency.client import RetryPolicy
from django_idempotency.inbox import WebhookReceiverView, inbox_handler
from django_idempotency.outbox import WebhookDispatcher, register_dispatcher
from django_idempotency.signing import StandardWebhooksSignature, StripeSignature
from payments.models import CustomerNotice, ProviderStatus, ReceiptEmail, Refund

HANDLER_DELAY = float(os.environ.get("EXAMPLE_INBOX_HANDLER_DELAY", "0"))
"""Seconds each handler below takes before it writes (``EXAMPLE_INBOX_HANDLER_DELAY``): a test
serving the project uses it to fail a handler while it runs."""


class ProviderWebhook(WebhookReceiverView):
    source = "provider"
    # The secrets are read at each delivery: a rotation needs no restart of the code.
    verifier = StripeSignature(lambda: settings.PROVIDER_WEBHOOK_SECRETS)


@inbox_handler("provider", "refund.pending", "refund.succeeded")
def refund_status_changed(event):
    """Record the refund's status at the provider; tell the customer once it succeeded."""
    time.sleep(HANDLER_DELAY)
    data = event.payload["data"]
    status = ProviderStatus(event.event_type.removeprefix("refund."))
    # Webhooks arrive out of order: apply only what is newer than what the refund shows.
    applied = Refund.objects.filter(
        pk=data["refund"], provider_sequence__lt=data["sequence"]
    ).update(provider_status=status, provider_sequence=data["sequence"])
    if applied and status == ProviderStatus.SUCCEEDED:
        refund = Refund.objects.select_related("payment").get(pk=data["refund"])
        CustomerNotice.objects.create(
            refund=refund,
            message=f"Your refund of {refund.amount} {refund.payment.currency} is on its way.",
        )


class PaymentEventsWebhook(WebhookReceiverView):
    """Our own payment events, as the outbox's webhook dispatcher signs them."""

    source = "payments"
    verifier = StandardWebhooksSignature(lambda: settings.PAYMENT_EVENTS_SECRETS)


#: The exchange the payment events are published to, when a broker carries them.
PAYMENT_EVENTS_EXCHANGE = "payment-events"

if settings.PAYMENT_EVENTS_BROKER_URL:
    from django_idempotency.brokers import BrokerDispatcher

    register_dispatcher(
        "payment.captured",
        BrokerDispatcher(
            settings.PAYMENT_EVENTS_BROKER_URL, PAYMENT_EVENTS_EXCHANGE, source="payments"
        ),
    )
else:
    register_dispatcher(
        "payment.captured",
        WebhookDispatcher(
            lambda: settings.PAYMENT_EVENTS_URL,
            lambda: settings.PAYMENT_EVENTS_SECRETS,
            # A few quick retries; after that, the outbox's own schedule retries.
            policy=RetryPolicy(max_attempts=3, deadline=5.0),
        ),
    )


@inbox_handler("payments", "payment.captured")
def payment_captured(event):
    """E-mail the receipt of a captured payment: delivered by webhook or by the broker."""
    time.sleep(HANDLER_DELAY)
    ReceiptEmail.objects.create(
        payment_id=event.payload["data"]["payment"], event_id=event.event_id
    )
