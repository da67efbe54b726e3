"""The payments' Celery tasks: each has its effect once, however often Celery delivers it."""

from __future__ import annotations

from typing import Any

from django_idempotency.celery import idempotent_task
from payments.models import ReceiptEmail


class MailServerDown(Exception):
    """The mail server did not answer: Celery tries again a moment later."""


# The key is the payment: one receipt per payment, whoever sends the task and how often.
# acks_late: a worker that dies mid-task leaves the message to be delivered again.
@idempotent_task(
    key=lambda payment_id, **_: f"receipt-{payment_id}",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(MailServerDown,),
    retry_backoff=True,
    max_retries=5,
)
def send_receipt(task: Any, payment_id: int, *, outages: int = 0) -> dict[str, Any]:
    """E-mail the receipt of a payment; return what was sent.

    The e-mail is a row that the mailer sends: it commits with the task's key, so a
    duplicate delivery finds the key stored and returns this result without a second e-mail.
    ``outages`` makes the first attempts fail, as a mail server that is down would.
    """
    receipt = ReceiptEmail.objects.create(payment_id=payment_id, event_id=f"task {task.request.id}")
    if task.request.retries < outages:
        raise MailServerDown(payment_id)
    return {"payment": payment_id, "receipt": receipt.pk, "attempt": task.request.retries + 1}
