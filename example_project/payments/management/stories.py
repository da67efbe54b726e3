"""The demo's stories: retries, duplicates, webhooks and edits, each checking what it did.

Each story uses fresh keys, so the demo can run again and again on the same database. Its
effect counts every row the story created, table by table, as the admin then lists them.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

from django.test import Client
from django.utils import timezone
from kombu import Connection, Exchange, Queue, binding

from django_idempotency import signals
from django_idempotency.brokers import BrokerDispatcher, MessageConsumer
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from django_idempotency.outbox import redeliver
from django_idempotency.signing import StripeSignature
from payments import provider
from payments.jobs import write_receipt
from payments.management.storytelling import (
    CHARGES,
    PAYMENTS,
    REFUNDS,
    WEBHOOKS,
    Answer,
    Api,
    Marks,
    Story,
    captured,
    delivery,
    new_key,
    payment_data,
    post_at_once,
    short,
)
from payments.models import (
    CustomerNotice,
    Payment,
    ProviderCharge,
    ReceiptEmail,
    Refund,
)
from payments.tasks import send_receipt
from payments.views import WorkerDied
from payments.webhooks import PAYMENT_EVENTS_EXCHANGE

if TYPE_CHECKING:
    from collections.abc import Callable

CONCURRENT_REQUESTS = 8


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
    # By default a 400 is an invalid request, not kept; the README says so. Say why this one is.
    story.exchange("the 400 is kept: the refund view", "a business answer, kept and replayed")
    story.exchange("sets invalid_request_status_codes", "(by default a 400 is not kept)")
    story.exchange("= (422,): only a 422 is invalid", "")
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


def crash_after_charge(host: str) -> Story:
    story, marks, alice, key = (
        Story("h. crash mid-charge"),
        Marks.now(),
        Api("alice", host),
        new_key(),
    )
    data = payment_data(4200, "card charge")
    try:
        crashed = "answered"
        alice.post(CHARGES, data, key, headers={"X-Demo-Crash": "die"})
    except WorkerDied:
        crashed = "no answer"
    story.exchange(f"POST charge 4200 eur, {short(key)}", f"{crashed}: died after the charge")
    # The sweeper runs once the dead request's lease ran out: here, with its clock moved on.
    later = timezone.now() + idempotency_settings.LEASE_TIMEOUT
    swept = IdempotencyKey.objects.settle_expired_leases(now=later)
    row = IdempotencyKey.objects.get(key=key)
    stored = json.loads(bytes(row.response_body or b"{}"))
    story.exchange(
        "sweeper asks the provider",
        f"{row.response_status} {row.state} payment {stored.get('id')}",
    )
    story.exchange("commit: outbox sends payment.captured", delivery(stored.get("id")))
    retry = alice.post(CHARGES, data, key)
    story.exchange("retry: the same POST, same key", retry.describe())
    new_charges = len(marks.new(ProviderCharge))
    story.effect = marks.effect()
    story.expect(crashed == "no answer", "the crashed request answered")
    story.expect(swept.reconciled >= 1, "the sweeper reconciled nothing")
    story.expect(row.state == "succeeded", "the sweeper stored no answer")
    story.expect(retry.idempotency_status == "replayed", "the retry was not replayed")
    story.expect(retry.data.get("id") == stored.get("id"), "the retry got another payment")
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


def receipt_task(host: str) -> Story:
    story, marks, alice = Story("l. a task sent 3 times"), Marks.now(), Api("alice", host)
    payment = alice.post(PAYMENTS, payment_data(1800, "receipt by task"), new_key())
    payment_id = payment.data.get("id")
    story.exchange("POST payment 1800 eur, a key", payment.describe())
    # The mail server is down for the first attempt: Celery retries, and the retry runs.
    first = send_receipt.delay(payment_id, outages=1).get()
    story.exchange("send_receipt (mail down once)", f"retried; receipt {first['receipt']}")
    # A producer that timed out sends it again; beat fires it on two schedulers.
    again = [send_receipt.delay(payment_id, outages=1).get() for _ in range(2)]
    story.exchange("sent twice more", f"both replay receipt {again[0]['receipt']}")
    story.effect = marks.effect()
    receipts = marks.new(ReceiptEmail)
    story.expect(payment.status == 201, "payment not created")
    story.expect(first["attempt"] == 2, "the first attempt did not fail and retry")
    story.expect(all(result == first for result in again), "a duplicate got another result")
    story.expect(len(receipts) == 1, "the receipt was not e-mailed exactly once")
    story.expect(
        IdempotencyKey.objects.filter(method="TASK", key=f"receipt-{payment_id}").count() == 1,
        "the task's key was not stored",
    )
    return story


def broker_redelivery(host: str) -> Story:
    story, marks = Story("m. 3 broker deliveries"), Marks.now()
    payment = Api("alice", host).post(PAYMENTS, payment_data(2200, "broker"), new_key())
    story.exchange("POST payment 2200 eur, a key", payment.describe())
    # An in-memory broker stands for RabbitMQ here; the code is the same.
    exchange = Exchange(PAYMENT_EVENTS_EXCHANGE, type="topic")
    queue = Queue(f"receipts-{uuid.uuid4().hex}", [binding(exchange, routing_key="payment.*")])
    with Connection("memory://") as connection:
        queue(connection.default_channel).declare()
    event = OutboxMessage(
        message_id=uuid.uuid4(),
        topic="payment.captured",
        payload={"payment": payment.data.get("id")},
        created_at=timezone.now(),
    )
    publisher = BrokerDispatcher("memory://", exchange, source="payments")
    for _ in range(3):  # a relay that died twice before marking it sent
        publisher(event)
    publisher.close()
    story.exchange("payment.captured published 3 times", "the broker delivers 3")
    duplicates: list[bool] = []

    def count_duplicate(**kwargs: Any) -> None:
        duplicates.append(True)

    signals.inbox_event_duplicate.connect(count_duplicate)
    try:
        consumer = MessageConsumer(Connection("memory://"), [queue], source="payments")
        for _ in consumer.consume(limit=3, timeout=5):
            pass
    finally:
        signals.inbox_event_duplicate.disconnect(count_duplicate)
    story.exchange("the consumer takes all 3", f"handled once, {len(duplicates)} duplicates")
    story.effect = marks.effect()
    story.expect(payment.status == 201, "payment not created")
    story.expect(len(duplicates) == 2, "the repeats were not duplicates")
    story.expect(len(marks.new(InboxEvent)) == 1, "not exactly one inbox event")
    story.expect(len(marks.new(ReceiptEmail)) == 1, "the receipt was not e-mailed exactly once")
    return story


def receipt_job(host: str) -> Story:
    story, marks, alice = Story("n. Django task, 3 times"), Marks.now(), Api("alice", host)
    payment = alice.post(PAYMENTS, payment_data(2400, "receipt by Django task"), new_key())
    payment_id = payment.data.get("id")
    story.exchange("POST payment 2400 eur, a key", payment.describe())
    # Django's Tasks framework, on its immediate backend: each enqueue runs the task here.
    results = [write_receipt.enqueue(payment_id) for _ in range(3)]
    values = [result.return_value for result in results]
    story.exchange("write_receipt enqueued 3 times", f"all return receipt {values[0]['receipt']}")
    story.effect = marks.effect()
    story.expect(payment.status == 201, "payment not created")
    story.expect(all(value == values[0] for value in values), "a run got another result")
    story.expect(len(marks.new(ReceiptEmail)) == 1, "the receipt was not written exactly once")
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
    receipt_task,
    broker_redelivery,
    receipt_job,
]
