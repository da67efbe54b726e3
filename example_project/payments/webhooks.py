"""The provider's webhooks: received into the inbox, then handled once each."""

from __future__ import annotations

from django.conf import settings

from django_idempotency.inbox import StripeSignature, WebhookReceiverView, inbox_handler
from payments.models import CustomerNotice, ProviderStatus, Refund


class ProviderWebhook(WebhookReceiverView):
    source = "provider"
    # The secrets are read at each delivery: a rotation needs no restart of the code.
    verifier = StripeSignature(lambda: settings.PROVIDER_WEBHOOK_SECRETS)


@inbox_handler("provider", "refund.pending", "refund.succeeded")
def refund_status_changed(event):
    """Record the refund's status at the provider; tell the customer once it succeeded."""
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
