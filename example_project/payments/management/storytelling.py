"""What the demo's stories are told with: a user's view of the API, and the rows a story made.

Every request goes through Django's test client: the real URLs, authentication, views and
database, without a server, but with the Host the project is then served on, so the links in
stored answers work.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import connection, models
from django.db.models import Max
from django.test import Client

from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from payments.models import (
    CustomerNotice,
    LedgerEntry,
    Payment,
    ProviderCharge,
    ReceiptEmail,
    Refund,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from django.http import HttpResponse

PASSWORD = "password"
PAYMENTS = "/api/payments/"
REFUNDS = "/api/refunds/"
CHARGES = "/api/charges/"
WEBHOOKS = "/webhooks/provider/"

M = TypeVar("M", bound=models.Model)


@dataclass(frozen=True)
class Answer:
    """What a client saw of one response."""

    status: int
    idempotency_status: str
    content: bytes
    data: dict[str, Any]
    location: str | None
    etag: str | None = None

    @classmethod
    def of(cls, response: HttpResponse) -> Answer:
        try:
            data = json.loads(response.content)
        except ValueError:
            data = {}
        return cls(
            status=response.status_code,
            idempotency_status=response.get("Idempotency-Status", ""),
            content=response.content,
            data=data if isinstance(data, dict) else {},
            location=response.get("Location"),
            etag=response.get("ETag"),
        )

    @property
    def code(self) -> str | None:
        return self.data.get("code")

    def describe(self, noun: str = "payment") -> str:
        """One short line: status, Idempotency-Status, and the id or error code."""
        if self.code:
            return f"{self.status} {self.code}"
        head = f"{self.status} {self.idempotency_status or '-':<8}"
        if self.status < 300:
            return f"{head} {noun} {self.data.get('id')}"
        if self.status == 400:
            return f"{head} invalid {', '.join(self.data)}"
        return head


class Api:
    """The payments API as one user sees it, with HTTP Basic authentication."""

    def __init__(self, username: str, host: str) -> None:
        token = base64.b64encode(f"{username}:{PASSWORD}".encode()).decode()
        # A view that raises answers 500 here, as it would to a real client. The Host header is
        # the one the project is served on, so the links in stored answers work when replayed.
        self.client = Client(
            headers={"Authorization": f"Basic {token}", "Host": host},
            raise_request_exception=False,
        )

    def post(
        self,
        path: str,
        data: dict[str, Any],
        key: str | None,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        headers = {**(headers or {}), **({"Idempotency-Key": key} if key else {})}
        response = self.client.post(path, data, content_type="application/json", headers=headers)
        return Answer.of(response)

    def get(self, path: str) -> Answer:
        return Answer.of(self.client.get(path))

    def patch(self, path: str, data: dict[str, Any], headers: dict[str, str]) -> Answer:
        response = self.client.patch(path, data, content_type="application/json", headers=headers)
        return Answer.of(response)


# Every table a story can add rows to, in the order the effect column lists them: what the
# admin then shows (and the provider's charges, which it keeps on its side).
TABLES: list[tuple[type[models.Model], str, str]] = [
    (IdempotencyKey, "idempotency key", "idempotency keys"),
    (Payment, "payment", "payments"),
    (Refund, "refund", "refunds"),
    (LedgerEntry, "ledger entry", "ledger entries"),
    (ProviderCharge, "card charge", "card charges"),
    (OutboxMessage, "outbox message", "outbox messages"),
    (InboxEvent, "inbox event", "inbox events"),
    (CustomerNotice, "customer notice", "customer notices"),
    (ReceiptEmail, "receipt e-mail", "receipt e-mails"),
]


@dataclass(frozen=True)
class Marks:
    """The newest row of each table, to find the rows a story created."""

    newest: dict[type[models.Model], int]

    @classmethod
    def now(cls) -> Marks:
        return cls(
            {
                model: model._default_manager.aggregate(newest=Max("pk"))["newest"] or 0
                for model, _one, _many in TABLES
            }
        )

    def new(self, model: type[M]) -> list[M]:
        """The rows of ``model`` created since these marks, oldest first."""
        return list(model._default_manager.filter(pk__gt=self.newest[model]).order_by("pk"))

    def new_payments(self) -> list[Payment]:
        return self.new(Payment)

    def new_refunds(self) -> list[Refund]:
        return self.new(Refund)

    def new_ledger_entries(self) -> list[LedgerEntry]:
        return self.new(LedgerEntry)

    def effect(self) -> list[str]:
        """Every row created since these marks, counted per table, as lines for the table."""
        counts = [(len(self.new(model)), one, many) for model, one, many in TABLES]
        lines = [f"+{n} {one if n == 1 else many}" for n, one, many in counts if n]
        return lines or ["no new rows"]


@dataclass
class Story:
    title: str
    sent: list[str] = field(default_factory=list)
    back: list[str] = field(default_factory=list)
    effect: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def exchange(self, sent: str, back: str) -> None:
        self.sent.append(sent)
        self.back.append(back)

    def expect(self, condition: bool, failure: str) -> None:
        if not condition:
            self.failures.append(failure)


def new_key() -> str:
    return str(uuid.uuid4())


def short(key: str) -> str:
    return f"key {key[:8]}"


def payment_data(amount: int, description: str) -> dict[str, Any]:
    return {"amount": amount, "currency": "eur", "description": description}


def post_at_once(n: int, data: dict[str, Any], key: str, host: str) -> list[Answer | Exception]:
    """Send the same POST from ``n`` threads, released together by a barrier."""
    barrier = threading.Barrier(n)
    answers: list[Answer | Exception] = [RuntimeError("no answer")] * n

    def send(index: int) -> None:
        try:
            api = Api("alice", host)
            barrier.wait()
            answers[index] = api.post(PAYMENTS, data, key)
        except Exception as exc:  # reported in the table, not lost in the thread
            answers[index] = exc
        finally:
            # Each thread opened its own connection; close it, or it stays open until exit.
            connection.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def captured(charge: Answer | Any) -> tuple[OutboxMessage | None, InboxEvent | None]:
    """The outbox message announcing a charge's payment (an answer, or the payment's id), and
    the inbox event it became."""
    payment = charge.data.get("id") if isinstance(charge, Answer) else charge
    message = OutboxMessage.objects.filter(payload__payment=payment).first()
    event = InboxEvent.objects.filter(event_id=str(message.message_id) if message else "").first()
    return message, event


def delivery(charge: Answer | Any) -> str:
    """What became of the announcement of a charge's payment, on both sides."""
    message, event = captured(charge)
    return f"{message.status if message else 'no message'}; inbox: {event.status if event else '-'}"


@contextmanager
def quiet(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Silence loggers below ``level``: the 4xx answers are the point of the stories."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, previous in zip(loggers, levels, strict=True):
            logger.setLevel(previous)
