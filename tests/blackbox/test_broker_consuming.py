"""The consumer as users run it, against what a hostile producer, a careless operator and an outage
do to it, on a RabbitMQ node and a Redis of the tests' own.

``idempotency_consume`` consumes the example project's payment events (its ``payment.captured``
handler e-mails one receipt per event, and its foreign key to the payment is checked at COMMIT).
Every count is read from the database afterwards: receipts, and inbox events by status.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid

import amqp
import pytest
import redis
from kombu import Connection, Queue
from psycopg import sql

from tests.blackbox.brokers import RabbitMQ, rabbitmq_installed
from tests.blackbox.harness import EXAMPLE, Process, Redis, environment, manage, run_sql, wait_for

pytestmark = pytest.mark.postgresql

SOURCE = "payments"
# RabbitMQ 4 gives quorum queues a delivery limit of 20 by default; 3.x needs it said.
QUORUM = {"x-queue-type": "quorum", "x-delivery-limit": 20}
OUTAGE = float(os.environ.get("TEST_BROKER_OUTAGE", "60"))


@pytest.fixture(scope="module")
def rabbitmq(tmp_path_factory):
    if not rabbitmq_installed():
        pytest.fail("the broker fault tests need rabbitmq-server (Debian's package)")
    node = RabbitMQ(tmp_path_factory.mktemp("rabbitmq"))
    node.start()
    yield node
    node.delete()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = Redis(tmp_path_factory.mktemp("redis") / "redis.log")
    server.wait_until_up()
    yield server
    server.stop()


@pytest.fixture(params=["rabbitmq", "redis"])
def broker_url(request):
    return request.getfixturevalue("redis_server" if request.param == "redis" else "rabbitmq").url


class Consumers:
    """``idempotency_consume`` processes of the test's, on its database; stopped at its end."""

    def __init__(self, database, tmp_path) -> None:
        self.env = environment(database, EXAMPLE_INBOX_HANDLER_DELAY="0.02")
        self.logs = tmp_path
        self.started: list[Process] = []

    def command(self, url: str, queue: str, *options: str) -> list[str]:
        return [
            sys.executable, str(EXAMPLE / "manage.py"), "idempotency_consume", queue,
            "--broker", url, "--source", SOURCE, *options,
        ]  # fmt: skip

    def start(self, url: str, queue: str, *options: str) -> Process:
        log = self.logs / f"consumer-{len(self.started)}.log"
        process = Process(self.command(url, queue, *options), env=self.env, log=log, cwd=EXAMPLE)
        self.started.append(process)
        return process

    def run(self, url: str, queue: str, *options: str) -> subprocess.CompletedProcess[str]:
        """Run one to its end, or for 30 seconds."""
        return subprocess.run(
            self.command(url, queue, *options),
            env=self.env,
            cwd=EXAMPLE,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def stop(self) -> None:
        for process in self.started:
            process.stop()

    def logs_text(self, tail: int = 4000) -> str:
        return "\n".join(p.read_text(errors="replace")[-tail:] for p in self.logs.glob("*.log"))


@pytest.fixture
def consumers(database, tmp_path):
    running = Consumers(database, tmp_path)
    yield running
    running.stop()
    print(running.logs_text())  # shown with a failure


def new_queue(url: str, **arguments) -> Queue:
    """A durable queue of the test's own, declared as an operator would, before any consumer."""
    queue = Queue(f"receipts-{uuid.uuid4().hex[:8]}", durable=True, queue_arguments=arguments)
    with Connection(url) as connection:
        queue(connection.default_channel).declare()
    return queue


def payments(database, count: int) -> list[int]:
    """Make ``count`` payments; return their ids."""
    return [
        row[0]
        for row in database.execute(
            "INSERT INTO payments_payment (owner_id, amount, currency, description, metadata, "
            "version, amount_refunded, provider_reference, created_at) "
            "SELECT (SELECT min(id) FROM auth_user), 100, 'eur', '', '{}', 1, 0, "
            "'ref-' || gen_random_uuid(), now() FROM generate_series(1, %s) RETURNING id",
            (count,),
        )
    ]


def publish(url: str, queue: Queue, payment: int, message_id: str | None = None) -> None:
    """Publish a payment's ``payment.captured`` event as the outbox would."""
    with Connection(url) as connection:
        connection.Producer().publish(
            {"id": message_id, "type": "payment.captured", "data": {"payment": payment}},
            routing_key=queue.name,
            serializer="json",
            message_id=message_id or str(uuid.uuid4()),
            type="payment.captured",
        )


def publish_raw(url: str, queue: Queue, body: bytes, content_type: str, **properties) -> None:
    """Publish what a careless producer might: bytes and properties as they are."""
    if url.startswith("amqp:"):
        with Connection(url) as connection:
            message = amqp.Message(body, content_type=content_type, **properties)
            connection.default_channel.basic_publish(message, exchange="", routing_key=queue.name)
        return
    item = {
        "body": base64.b64encode(body).decode(),
        "content-type": content_type,
        "content-encoding": "utf-8",
        "headers": {},
        "properties": {
            "delivery_tag": str(uuid.uuid4()),
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": queue.name},
            **properties,
        },
    }
    push(url, queue, json.dumps(item).encode())


def push(url: str, queue: Queue, item: bytes) -> None:
    """Put ``item`` on a Redis queue's list, as a producer without kombu might."""
    client = redis.Redis.from_url(url)
    client.lpush(queue.name, item)
    client.close()


def ready(url: str, queue: Queue) -> int:
    """Messages in the queue that no consumer holds."""
    if url.startswith("redis:"):
        return int(redis.Redis.from_url(url).llen(queue.name))
    with Connection(url) as connection:
        return int(queue(connection.default_channel).queue_declare(passive=True).message_count)


def statuses(database) -> dict[str, int]:
    rows = database.execute("SELECT status, count(*) FROM django_idempotency_inboxevent GROUP BY 1")
    return dict(rows)


def receipts(database) -> int:
    return database.count("payments_receiptemail")


def one_receipt_each(database) -> bool:
    twice = database.execute(
        "SELECT payment_id FROM payments_receiptemail GROUP BY 1 HAVING count(*) > 1"
    )
    return not twice


# Each with a body of its own: those without an id to trust are recorded by their body's hash.
HOSTILE = [
    ("NUL in type", b'{"n": 1}', "application/json", {"message_id": "h-1", "type": "a\x00b"}),
    ("surrogate in type", b'{"n": 2}', "application/json", {"message_id": "h-2", "type": "\ud800"}),
    ("surrogate in id", b'{"n": 3}', "application/json", {"message_id": "h\udfff", "type": "t"}),
    ("no id", b'{"n": 4}', "application/json", {"type": "payment.captured"}),
    ("not JSON", b"<xml/>", "application/json", {"message_id": "h-5", "type": "t"}),
    ("deep JSON", b"[" * 200 + b"]" * 200, "application/json", {"message_id": "h-6", "type": "t"}),
    ("binary", os.urandom(64), "application/octet-stream", {"message_id": "h-7", "type": "t"}),
    ("NUL in JSON", b'{"n": "\\u0000"}', "application/json", {"message_id": "h-8", "type": "t"}),
    ("surrogate in JSON", b'{"n": "\\udbff"}', "application/json", {"message_id": "h-9"}),
    ("not UTF-8", b'{"n": "\xff"}', "application/json", {"message_id": "h-10", "type": "t"}),
]
# What only AMQP can carry: bytes that are not UTF-8 in a short-string property.
HOSTILE_AMQP = [("id not UTF-8", b'{"n": 11}', "application/json", {"message_id": b"\xff\xfe"})]
# What only a Redis list can hold: items that are no kombu message.
HOSTILE_REDIS_ITEMS = [
    b"not json at all",
    b"[1, 2, 3]",
    b'{"body": "eyJuIjogMTJ9"}',
    b'{"properties": {"delivery_tag": "t"}, "body": "x"}',
    b'{"body": "!!!", "properties": {"delivery_tag": "t", "body_encoding": "base64", '
    b'"delivery_info": {"exchange": "", "routing_key": "q"}}}',
]
# Nested too deep for kombu to read as JSON: nothing of it comes through, so it is refused with a
# log line and a metric, not kept.
TOO_DEEP_ITEM = b"[" * 5000 + b"]" * 5000


def test_whatever_a_producer_sends_the_consumer_keeps_and_goes_on(broker_url, database, consumers):
    queue = new_queue(broker_url)
    consumer = consumers.start(broker_url, queue.name, "--concurrency", "2")
    good = payments(database, 20)
    hostile = [*HOSTILE, *(HOSTILE_AMQP if broker_url.startswith("amqp:") else [])]
    items = HOSTILE_REDIS_ITEMS if broker_url.startswith("redis:") else []
    if items:
        push(broker_url, queue, TOO_DEEP_ITEM)
    # Good and hostile in turn: a message that stops the consumer leaves the rest unhandled.
    for number, payment in enumerate(good):
        if number < len(hostile):
            _name, body, content_type, properties = hostile[number]
            publish_raw(broker_url, queue, body, content_type, **properties)
        if number < len(items):
            push(broker_url, queue, items[number])
        publish(broker_url, queue, payment)

    def settled() -> bool:
        return statuses(database).get("dead", 0) >= len(hostile) + len(items)

    try:
        wait_for(lambda: receipts(database) == len(good) and settled(), timeout=60, what="all")
    except AssertionError:
        print("receipts", receipts(database), "events", statuses(database))
        print(consumers.logs_text())
        raise
    deep = 1 if items else 0
    counts = {
        "sent": len(good) + len(hostile) + len(items) + deep,
        "receipts": receipts(database),
        "events": statuses(database),
        "consumer alive": consumer.popen.poll() is None,
        "left in the queue": ready(broker_url, queue),
    }
    print("hostile producer:", json.dumps(counts))
    assert counts == {
        "sent": len(good) + len(hostile) + len(items) + deep,
        "receipts": len(good),
        "events": {"processed": len(good), "dead": len(hostile) + len(items)},
        "consumer alive": True,
        "left in the queue": 0,
    }
    reasons = [
        reason
        for (reason,) in database.execute(
            "SELECT last_error FROM django_idempotency_inboxevent WHERE status = 'dead'"
        )
    ]
    assert all(reasons), reasons
    if items:
        log = consumers.logs_text(tail=10**7)
        assert "refused a message from the broker that cannot be read" in log


def test_a_handler_that_fails_at_commit_keeps_the_message_under_its_own_id(
    rabbitmq, database, consumers
):
    url = rabbitmq.url
    queue = new_queue(url)
    consumers.start(url, queue.name)
    missing = 900_000_001  # no such payment: the receipt's foreign key fails the COMMIT
    publish(url, queue, missing, message_id="m-missing")
    publish(url, queue, missing, message_id="m-missing")  # and delivered again
    wait_for(
        lambda: (
            database.execute(
                "SELECT deliveries FROM django_idempotency_inboxevent WHERE event_id = 'm-missing'"
            )
            == [(2,)]
        ),
        timeout=30,
        what="the event and its second delivery",
    )
    [(event_id, status, attempts, payment, error)] = database.execute(
        "SELECT event_id, status, attempts, payload -> 'data' ->> 'payment', last_error "
        "FROM django_idempotency_inboxevent"
    )
    assert (event_id, status, attempts, payment) == ("m-missing", "failed", 1, str(missing))
    assert error.startswith("IntegrityError")
    # Once the payment exists, a person's reprocess hands the handler the message's own body.
    database.execute(
        "INSERT INTO payments_payment (id, owner_id, amount, currency, description, metadata, "
        "version, amount_refunded, provider_reference, created_at) VALUES "
        "(%s, (SELECT min(id) FROM auth_user), 1, 'eur', '', '{}', 1, 0, 'ref-missing', now())",
        (missing,),
    )
    manage(
        consumers.env, "shell", "-c",
        "from django_idempotency.inbox import reprocess; "
        "from django_idempotency.models import InboxEvent; "
        "reprocess(InboxEvent.objects.filter(event_id='m-missing'))",
    )  # fmt: skip
    assert statuses(database) == {"processed": 1}
    assert database.execute("SELECT payment_id, event_id FROM payments_receiptemail") == [
        (missing, "m-missing")
    ]


def test_a_database_outage_loses_no_message_of_a_quorum_queue_with_a_delivery_limit(
    rabbitmq, database, consumers
):
    url, sent = rabbitmq.url, 200
    queue = new_queue(url, **QUORUM)
    arguments = [f"--queue-argument=x-queue-type={QUORUM['x-queue-type']}"]
    arguments += [f"--queue-argument=x-delivery-limit={QUORUM['x-delivery-limit']}"]
    consumers.start(url, queue.name, "--concurrency", "2", "--prefetch", "1", *arguments)
    for payment in payments(database, sent):
        publish(url, queue, payment)
    wait_for(lambda: receipts(database) >= 20, timeout=30, what="the first receipts")
    # The database refuses every connection, the consumers' included, for OUTAGE seconds.
    name = sql.Identifier(database.name)
    run_sql(database.admin_url, sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(name))
    try:
        run_sql(
            database.admin_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
            (database.name,),
        )
        time.sleep(OUTAGE)
    finally:
        run_sql(
            database.admin_url, sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(name)
        )
    during = receipts(database)
    # Held, not dropped: once the database answers, every message is handled.
    wait_for(lambda: receipts(database) == sent, timeout=90, what="every receipt")
    time.sleep(2)  # nothing more comes
    counts = {
        "sent": sent,
        "receipts before the outage ended": during,
        "receipts": receipts(database),
        "lost": sent - receipts(database),
        "left in the queue": ready(url, queue),
        "events": statuses(database),
    }
    print(f"database outage of {OUTAGE:.0f} s:", json.dumps(counts))
    assert counts["lost"] == 0
    assert counts["events"] == {"processed": sent}
    assert one_receipt_each(database)


def test_a_queue_declared_otherwise_fails_the_command_at_start_then_consumes_as_declared(
    rabbitmq, database, consumers
):
    url = rabbitmq.url
    queue = new_queue(url, **QUORUM)
    good = payments(database, 20)
    for payment in good:
        publish(url, queue, payment)
    started = time.monotonic()
    refused = consumers.run(url, queue.name)
    seconds = time.monotonic() - started
    assert refused.returncode != 0
    assert "PRECONDITION_FAILED" in refused.stderr
    assert "--queue-argument" in refused.stderr
    assert seconds < 20
    arguments = [f"--queue-argument={name}={value}" for name, value in QUORUM.items()]
    consumers.start(url, queue.name, *arguments)
    wait_for(lambda: receipts(database) == len(good), timeout=30, what="every receipt")
    assert statuses(database) == {"processed": len(good)}
    # And a source that no event can be recorded as fails at start too, not on each message.
    too_long = consumers.run(url, queue.name, "--source", "s" * 101)
    assert too_long.returncode != 0
    assert "1 to 100 characters" in too_long.stderr


def test_the_same_message_id_with_another_body_is_kept_as_a_conflict(
    broker_url, database, consumers
):
    queue = new_queue(broker_url)
    first, second = payments(database, 2)
    consumers.start(broker_url, queue.name)
    publish(broker_url, queue, first, message_id="m-1")
    publish(broker_url, queue, second, message_id="m-1")

    def conflict():
        return database.execute(
            "SELECT status, payload -> 'data' ->> 'payment', conflicts, "
            "conflicting_payload -> 'data' ->> 'payment', last_conflict_at IS NOT NULL "
            "FROM django_idempotency_inboxevent"
        )

    wait_for(lambda: conflict() and conflict()[0][2] == 1, timeout=30, what="the conflict")
    assert conflict() == [("processed", str(first), 1, str(second), True)]
    assert database.execute("SELECT payment_id FROM payments_receiptemail") == [(first,)]
