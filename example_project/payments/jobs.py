"""The payments' tasks on Django's Tasks framework: each has its effect once, however often it is
enqueued. The project runs them with the framework's immediate backend (no worker); with a worker
backend, such as django-tasks-db's, the code is the same."""

from __future__ import annotations

from typing import Any

from django_idempotency.django_tasks import idempotent_task
from payments.models import ReceiptEmail


# The key is the payment: one receipt per payment, whoever enqueues the task and how often.
@idempotent_task(key=lambda payment_id: f"receipt-job-{payment_id}")
def write_receipt(payment_id: int) -> dict[str, Any]:
    """Write the receipt of a payment for the mailer; return what was written.

    The receipt is a row that commits with the task's key, so a run enqueued again finds the
    key stored and returns this result without a second receipt.
    """
    receipt = ReceiptEmail.objects.create(payment_id=payment_id, event_id="django task")
    return {"payment": payment_id, "receipt": receipt.pk}
