"""``manage.py demo``: play retry stories against the payments API and check what they did.

Every request goes through Django's test client: the real URLs, authentication, views and
database, without a server, but with the Host the project is then served on (``--port``), so
the links in stored answers work. Each story uses fresh keys, so the demo can run again and again
on the same database; its last column counts every row the story created, table by table, as the
admin then lists them. It exits non-zero when a check fails, so it doubles as a smoke test.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from django.contrib.auth import get_user_model
from django.core.handlers.wsgi import WSGIHandler
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.db import connection, models
from django.db.models import Max
from django.test import Client, override_settings

from django_idempotency import signals
from django_idempotency.inbox import StripeSignature
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from django_idempotency.outbox import redeliver
from payments import provider
from payments.models import (
    CustomerNotice,
    LedgerEntry,
    Payment,
    ProviderCharge,
    ReceiptEmail,
    Refund,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from django.core.management.base import CommandParser
    from django.http import HttpResponse

PASSWORD = "password"
PAYMENTS = "/api/payments/"
REFUNDS = "/api/refunds/"
CHARGES = "/api/charges/"
WEBHOOKS = "/webhooks/provider/"
ADDRESS = "127.0.0.1"
DEFAULT_PORT = 8000
CONCURRENT_REQUESTS = 8
# Column widths of the table: story, what was sent, what came back, effect in the database.
WIDTHS = (22, 38, 36, 20)

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


def double_click(host: str) -> Story:
    story, marks, alice, key = Story("a. double-click"), Marks.now(), Api("alice", host), new_key()
    data = payment_data(1000, "double-click")
    first = alice.post(PAYMENTS, data, key)
    story.exchange(f"POST payment 1000 eur, {short(key)}", first.describe())
    second = alice.post(PAYMENTS, data, key)
    same = "same bytes" if second.content == first.content else "other bytes!"
    story.exchange("the same POST again", f"{second.describe()}, {same}")
    story.effect = marks.effect()
    story.expect(first.status == 201 and first.idempotency_status == "stored", "first not stored")
    story.expect(second.idempotency_status == "replayed", "second not replayed")
    story.expect(second.content == first.content, "replayed body differs")
    story.expect(second.location == first.location, "replayed Location differs")
    story.expect(len(marks.new_payments()) == 1, "not exactly one payment")
    story.expect(len(marks.new_ledger_entries()) == 1, "not exactly one ledger entry")
    return story


def lost_response(host: str) -> Story:
    story, marks, alice, key = Story("b. lost response"), Marks.now(), Api("alice", host), new_key()
    data = payment_data(2500, "lost response")
    alice.post(PAYMENTS, data, key)
    story.exchange(f"POST payment 2500 eur, {short(key)}", "(lost: the client times out)")
    retry = alice.post(PAYMENTS, data, key)
    story.exchange("retry: the same POST, same key", retry.describe())
    story.effect = marks.effect()
    created = marks.new_payments()
    story.expect(retry.idempotency_status == "replayed", "retry not replayed")
    story.expect(len(created) == 1, "not exactly one payment")
    story.expect(
        bool(created) and retry.data.get("id") == created[0].pk, "retry got another payment"
    )
    return story


def changed_amount(host: str) -> Story:
    story, marks, alice, key = (
        Story("c. retry, new amount"),
        Marks.now(),
        Api("alice", host),
        new_key(),
    )
    first = alice.post(PAYMENTS, payment_data(1000, "changed amount"), key)
    story.exchange(f"POST payment 1000 eur, {short(key)}", first.describe())
    retry = alice.post(PAYMENTS, payment_data(1500, "changed amount"), key)
    story.exchange("retry with 1500 eur, same key", retry.describe())
    story.effect = marks.effect()
    created = marks.new_payments()
    story.expect(retry.status == 422, "changed retry not answered 422")
    story.expect(retry.code == "idempotency.payload_mismatch", "wrong error code")
    story.expect([p.amount for p in created] == [1000], "not exactly one payment of 1000")
    return story


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


def concurrent_duplicates(host: str) -> Story:
    n = CONCURRENT_REQUESTS
    story, marks, key = Story(f"d. {n} at the same time"), Marks.now(), new_key()
    answers = post_at_once(n, payment_data(700, "concurrent"), key, host)
    got = [answer for answer in answers if isinstance(answer, Answer)]
    errors = [answer for answer in answers if isinstance(answer, Exception)]
    tally = Counter(f"{a.status} {a.code or a.idempotency_status}" for a in got)
    tally.update(type(error).__name__ for error in errors)
    ids = {a.data.get("id") for a in got if a.status == 201}
    # Most common first: on SQLite the duplicates queue for the write lock and then replay.
    outcomes = [f"{count} got {outcome}" for outcome, count in tally.most_common()]
    story.sent = [f"{n} threads POST 700 eur at once,", f"all with {short(key)}"]
    story.back = [*outcomes, f"all 201s name payment {', '.join(map(str, sorted(ids)))}"]
    story.effect = marks.effect()
    story.expect(not errors, f"{len(errors)} requests raised")
    story.expect(
        all(a.status == 201 or a.code == "idempotency.in_progress" for a in got),
        "an answer other than 201 or 409 in_progress",
    )
    story.expect(tally["201 stored"] == 1, "not exactly one stored answer")
    story.expect(len({a.content for a in got if a.status == 201}) == 1, "201 bodies differ")
    story.expect(len(marks.new_payments()) == 1, "not exactly one payment")
    story.expect(len(marks.new_ledger_entries()) == 1, "not exactly one ledger entry")
    return story


def refund_replayed(host: str) -> Story:
    story, marks, alice = Story("e. refund replayed"), Marks.now(), Api("alice", host)
    key = new_key()
    payment = alice.post(PAYMENTS, payment_data(3000, "refunded"), key)
    story.exchange(f"POST payment 3000 eur, {short(key)}", payment.describe())
    payment_id = payment.data.get("id")
    refund, key = {"payment": payment_id, "amount": 1000}, new_key()
    first = alice.post(REFUNDS, refund, key)
    story.exchange(f"POST refund 1000, {short(key)}", first.describe("refund"))
    second = alice.post(REFUNDS, refund, key)
    story.exchange("the same refund again", second.describe("refund"))
    too_much, key = {"payment": payment_id, "amount": 5000}, new_key()
    over = alice.post(REFUNDS, too_much, key)
    story.exchange(f"POST refund 5000, {short(key)}", over.describe())
    over_again = alice.post(REFUNDS, too_much, key)
    story.exchange("the same over-refund again", over_again.describe())
    story.effect = marks.effect()
    refunds = marks.new_refunds()
    story.expect(payment.status == 201, "payment not created")
    story.expect(second.idempotency_status == "replayed", "refund not replayed")
    story.expect(second.content == first.content, "replayed refund differs")
    story.expect([r.amount for r in refunds] == [1000], "not exactly one refund of 1000")
    story.expect(len(marks.new_ledger_entries()) == 2, "not one charge and one refund entry")
    story.expect(over.status == 400 and over.idempotency_status == "stored", "over-refund: no 400")
    story.expect(over_again.idempotency_status == "replayed", "over-refund 400 not replayed")
    story.expect(over_again.content == over.content, "replayed 400 differs")
    return story


def two_users(host: str) -> Story:
    story, marks, key = Story("f. alice & bob, 1 key"), Marks.now(), new_key()
    alice, bob = Api("alice", host), Api("bob", host)
    for_alice = alice.post(PAYMENTS, payment_data(1200, "alice"), key)
    story.exchange(f"alice: POST 1200 eur, {short(key)}", for_alice.describe())
    for_bob = bob.post(PAYMENTS, payment_data(900, "bob"), key)
    story.exchange(f"bob:   POST 900 eur, {short(key)}", for_bob.describe())
    peek = bob.get(f"{PAYMENTS}{for_alice.data.get('id')}/")
    seen = "not found" if peek.status == 404 else "shown to bob!"
    story.exchange("bob:   GET alice's payment", f"{peek.status} {seen}")
    story.effect = marks.effect()
    owners = {p.pk: (p.owner.username, p.amount) for p in marks.new_payments()}
    story.expect(for_bob.idempotency_status == "stored", "bob's request was not run as his own")
    story.expect(
        owners == {for_alice.data.get("id"): ("alice", 1200), for_bob.data.get("id"): ("bob", 900)},
        "payments not one each, with their own amounts",
    )
    story.expect(peek.status == 404, "bob can see alice's payment")
    return story


def missing_key(host: str) -> Story:
    story, marks = Story("g. no key"), Marks.now()
    answer = Api("alice", host).post(PAYMENTS, payment_data(1000, "no key"), key=None)
    story.exchange("POST payment, no key header", answer.describe())
    story.effect = marks.effect()
    story.expect(
        answer.status == 400 and answer.code == "idempotency.key_missing", "not 400 key_missing"
    )
    story.expect(not marks.new_payments(), "a payment was created")
    return story


def captured(charge: Answer) -> tuple[OutboxMessage | None, InboxEvent | None]:
    """The outbox message announcing a charge's payment, and the inbox event it became."""
    message = OutboxMessage.objects.filter(payload__payment=charge.data.get("id")).first()
    event = InboxEvent.objects.filter(event_id=str(message.message_id) if message else "").first()
    return message, event


def delivery(charge: Answer) -> str:
    """What became of the announcement of a charge's payment, on both sides."""
    message, event = captured(charge)
    return f"{message.status if message else 'no message'}; inbox: {event.status if event else '-'}"


def crash_after_charge(host: str) -> Story:
    story, marks, alice, key = (
        Story("h. crash mid-charge"),
        Marks.now(),
        Api("alice", host),
        new_key(),
    )
    data = payment_data(4200, "card charge")
    with quiet("django.request", level=logging.CRITICAL):  # the 500's traceback is expected
        crashed = alice.post(CHARGES, data, key, headers={"X-Demo-Crash": "yes"})
    story.exchange(
        f"POST charge 4200 eur, {short(key)}", f"{crashed.status}: died after the charge"
    )
    retry = alice.post(CHARGES, data, key)
    story.exchange("retry: the same POST, same key", f"{retry.describe()} (recovered)")
    story.exchange("commit: outbox sends payment.captured", delivery(retry))
    again = alice.post(CHARGES, data, key)
    story.exchange("the same POST once more", again.describe())
    new_charges = len(marks.new(ProviderCharge))
    story.effect = marks.effect()
    story.expect(crashed.status == 500, "the crash did not answer 500")
    story.expect(retry.idempotency_status == "stored", "the retry was not stored")
    story.expect(again.idempotency_status == "replayed", "the last POST was not replayed")
    story.expect(new_charges == 1, "the card was not charged exactly once")
    story.expect(len(marks.new_payments()) == 1, "not exactly one payment")
    return story


def provider_webhooks(host: str) -> Story:
    story, marks, alice = Story("i. provider webhooks"), Marks.now(), Api("alice", host)
    payment = alice.post(PAYMENTS, payment_data(2000, "refunded by webhook"), new_key())
    story.exchange("POST payment 2000 eur, a key", payment.describe())
    refund = alice.post(REFUNDS, {"payment": payment.data.get("id"), "amount": 800}, new_key())
    refund_id = int(refund.data.get("id") or 0)
    story.exchange("POST refund 800, another key", refund.describe("refund"))
    pending, succeeded = provider.refund_events(refund_id)
    deliveries = [
        ("refund.succeeded (seq 2)", succeeded, None),
        ("refund.pending (seq 1), late", pending, None),
        ("refund.succeeded again", succeeded, None),
        ("refund.pending again", pending, None),
        ("a forged succeeded", {**succeeded, "id": "evt_forged"}, "whsec_not-the-secret"),
    ]
    answers = []
    for label, event, secret in deliveries:
        body, headers = provider.signed(event)
        if secret:
            headers = StripeSignature([secret]).sign(body)
        answer = Answer.of(
            Client(headers={"Host": host}).post(
                WEBHOOKS, body, content_type="application/json", headers=headers
            )
        )
        answers.append(answer)
        story.exchange(
            f"provider: {label}", f"{answer.status} {answer.code or answer.data.get('status')}"
        )
    recorded = InboxEvent.objects.filter(event_id__in=[pending["id"], succeeded["id"]])
    new_notices = len(marks.new(CustomerNotice))
    status = Refund.objects.get(pk=refund_id).provider_status if refund_id else "?"
    story.effect = [*marks.effect(), f"refund {status}"]
    story.expect(
        [a.data.get("status") for a in answers[:4]]
        == ["processed", "processed", "duplicate", "duplicate"],
        "not processed twice, then duplicates",
    )
    story.expect(answers[4].code == "inbox.signature_invalid", "the forgery was not refused")
    story.expect(
        sorted(recorded.values_list("status", flat=True)) == ["processed", "processed"],
        "not exactly two events recorded and processed",
    )
    story.expect(len(marks.new(InboxEvent)) == 2, "the forgery was recorded")
    story.expect(new_notices == 1, "the customer was not told exactly once")
    story.expect(status == "succeeded", "the late pending event undid the success")
    return story


def outbox_to_inbox(host: str) -> Story:
    story, marks, key = Story("j. outbox to inbox"), Marks.now(), new_key()
    charge = Api("alice", host).post(CHARGES, payment_data(3100, "outbox"), key)
    story.exchange(f"POST charge 3100 eur, {short(key)}", charge.describe())
    message, event = captured(charge)
    story.exchange("commit: outbox sends payment.captured", delivery(charge))
    duplicates: list[bool] = []

    def count_duplicate(**kwargs: Any) -> None:
        duplicates.append(True)

    signals.inbox_event_duplicate.connect(count_duplicate)
    try:
        # What a relay that died after sending, before marking the message, would do.
        redeliver(OutboxMessage.objects.filter(pk=message.pk if message else None))
    finally:
        signals.inbox_event_duplicate.disconnect(count_duplicate)
    story.exchange("a relay dies; sent again", f"inbox: {'duplicate' if duplicates else '?'}")
    new_receipts = len(marks.new(ReceiptEmail))
    story.effect = marks.effect()
    story.expect(charge.status == 201, "the charge was not made")
    story.expect(message is not None and message.status == "dispatched", "not dispatched")
    story.expect(event is not None and event.status == "processed", "not processed by the inbox")
    story.expect(duplicates == [True], "the second delivery was not a duplicate")
    story.expect(len(marks.new(OutboxMessage)) == 1, "not exactly one outbox message")
    story.expect(len(marks.new(InboxEvent)) == 1, "not exactly one inbox event")
    story.expect(new_receipts == 1, "the receipt was not e-mailed exactly once")
    return story


def lost_update(host: str) -> Story:
    story, marks, alice = Story("k. two edits, one ETag"), Marks.now(), Api("alice", host)
    key = new_key()
    created = alice.post(PAYMENTS, payment_data(4200, "unsorted"), key)
    story.exchange(f"POST payment 4200 eur, {short(key)}", created.describe())
    url = f"{PAYMENTS}{created.data.get('id')}/"
    read = alice.get(url)
    story.exchange("two clerks GET it", f"{read.status}, both see ETag {read.etag}")
    key = new_key()
    first = alice.patch(
        url, {"description": "gift"}, {"If-Match": read.etag or "", "Idempotency-Key": key}
    )
    story.exchange(
        f"clerk 1: PATCH gift, If-Match {read.etag},", f"{first.status}, ETag {first.etag}"
    )
    story.exchange(f"  {short(key)}", "")
    second = alice.patch(url, {"description": "office"}, {"If-Match": read.etag or ""})
    story.exchange(
        f"clerk 2: PATCH office, If-Match {read.etag}", f"{second.describe()}, ETag {second.etag}"
    )
    # Clerk 1's answer was lost: the same PATCH, sent again with its key, gets that answer back
    # rather than a 412 for the If-Match its own edit made stale.
    retry = alice.patch(
        url, {"description": "gift"}, {"If-Match": read.etag or "", "Idempotency-Key": key}
    )
    story.exchange(
        "clerk 1 again (answer lost), same key",
        f"{retry.status} {retry.idempotency_status}: clerk 1's answer",
    )
    payment = Payment.objects.filter(pk=created.data.get("id")).first()
    story.effect = [
        *marks.effect(),
        *(
            [f"description: {payment.description}", f"version {payment.version}"]
            if payment
            else ["no payment"]
        ),
    ]
    story.expect(first.status == 200 and first.etag != read.etag, "first edit not applied")
    story.expect(second.code == "precondition.failed", "the stale edit was not refused")
    story.expect(second.etag == first.etag, "412 without the current ETag")
    story.expect(retry.idempotency_status == "replayed", "the retried edit was not replayed")
    story.expect(retry.content == first.content, "the replayed edit differs")
    story.expect(payment is not None and payment.description == "gift", "an edit was lost")
    story.expect(payment is not None and payment.version == 2, "not exactly one new version")
    return story


STORIES: list[Callable[[str], Story]] = [
    double_click,
    lost_response,
    changed_amount,
    concurrent_duplicates,
    refund_replayed,
    two_users,
    missing_key,
    crash_after_charge,
    provider_webhooks,
    outbox_to_inbox,
    lost_update,
]


def ensure_free(port: int) -> None:
    """Fail with a message that says what to do when ``port`` is taken, not with a traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the development server binds: a port left in TIME_WAIT by a stopped server is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ADDRESS, port))
        except OSError as exc:
            msg = (
                f"Cannot serve on {ADDRESS}:{port}: {exc.strerror or exc}. Another server (an "
                "earlier demo?) may be using it: stop it, or choose another port with --port."
            )
            raise CommandError(msg) from exc


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


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


class Command(BaseCommand):
    help = "Play idempotency stories against the payments API and check their effect."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--serve",
            action="store_true",
            help=f"Then run the development server on {ADDRESS}:{DEFAULT_PORT}.",
        )
        parser.add_argument(
            "--port",
            type=int,
            default=None,
            help=f"The port to serve on (default {DEFAULT_PORT}); implies --serve.",
        )

    def handle(
        self, *args: Any, serve: bool = False, port: int | None = None, **options: Any
    ) -> None:
        serve = serve or port is not None
        port = DEFAULT_PORT if port is None else port
        if serve:
            ensure_free(port)  # before the stories: they take seconds, and change the database
        host = f"{ADDRESS}:{port}"
        call_command("migrate", verbosity=0)
        self.ensure_users()
        database = connection.settings_dict["NAME"]
        name = Path(database).name if connection.vendor == "sqlite" else database
        self.stdout.write(f"Idempotency stories against {connection.vendor} database {name}\n")
        self.row(("story", "what was sent", "what came back", "database"), "")
        self.row(tuple("-" * width for width in WIDTHS), "")
        failed = []
        with quiet("django.request", "django_idempotency"), self.payment_events_served():
            for play in STORIES:
                story = play(host)
                self.show(story)
                if story.failures:
                    failed.append(story.title)
        if failed:
            msg = f"{len(failed)} of {len(STORIES)} stories failed: {', '.join(failed)}."
            raise CommandError(msg)
        self.stdout.write(self.style.SUCCESS(f"All {len(STORIES)} stories behaved as promised."))
        if serve:
            self.serve(port)

    @contextmanager
    def payment_events_served(self) -> Iterator[None]:
        """Serve this project over HTTP on loopback, for the outbox to deliver to."""
        server = ThreadedWSGIServer(("127.0.0.1", 0), QuietHandler)
        server.set_app(WSGIHandler())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/webhooks/payments/"
        try:
            with override_settings(PAYMENT_EVENTS_URL=url):
                yield
        finally:
            server.shutdown()
            server.server_close()
            thread.join()

    def ensure_users(self) -> None:
        users = get_user_model().objects
        for username in ("alice", "bob"):
            if not users.filter(username=username).exists():
                users.create_user(username=username, password=PASSWORD)
        if not users.filter(username="admin").exists():
            users.create_superuser(username="admin", email="", password="admin")

    def row(self, cells: tuple[str, ...], mark: str) -> None:
        padded = [cell.ljust(width) for cell, width in zip(cells, WIDTHS, strict=True)]
        self.stdout.write(f"{'  '.join(padded)}  {mark}".rstrip())

    def show(self, story: Story) -> None:
        mark = self.style.SUCCESS("✔") if not story.failures else self.style.ERROR("✘")
        height = max(len(story.sent), len(story.back), len(story.effect))
        for line in range(height):
            cells = tuple(
                column[line] if line < len(column) else ""
                for column in ([story.title], story.sent, story.back, story.effect)
            )
            self.row(cells, mark if line == 0 else "")
        for failure in story.failures:
            self.stdout.write(self.style.ERROR(f"{'':{WIDTHS[0]}}  ✘ {failure}"))
        self.stdout.write("")

    def serve(self, port: int) -> None:
        ensure_free(port)  # again: something may have taken it while the stories played
        site = f"http://{ADDRESS}:{port}"
        self.stdout.write(
            f"\nThe API:   {site}/api/payments/ and /api/refunds/"
            f" (alice or bob, password {PASSWORD!r})\n"
            f"The admin: {site}/admin/ (admin, password 'admin')\n"
            f"OpenAPI:   {site}/api/schema/   Metrics: {site}/metrics/\n"
            "Try it:\n"
            "  curl -i -u alice:password -H 'Idempotency-Key: my-first-key' \\\n"
            "       -H 'Content-Type: application/json' \\\n"
            f'       -d \'{{"amount": 1000, "currency": "eur"}}\' {site}/api/payments/\n'
        )
        # Without the autoreloader: it would start this command, stories and all, a second time.
        call_command("runserver", f"{ADDRESS}:{port}", use_reloader=False)
