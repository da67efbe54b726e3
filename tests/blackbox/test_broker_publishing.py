"""A broker that stops taking messages holds no request beyond the inline runner's bound.

The example project, served by gunicorn on PostgreSQL with the inline outbox runner, publishes
each captured payment's event to a RabbitMQ node of the test's own. A first charge's event is
sent at once. With the node then under a memory alarm (it blocks every publishing connection), a
charge still answers 201 within the bound, and its event stays pending; once the alarm clears, the
periodic relay sends it, and the consumer handles each event once.
"""

from __future__ import annotations

import json
import sys

import pytest
from kombu import Connection, Exchange, Queue, binding

from tests.blackbox.brokers import RabbitMQ, rabbitmq_installed
from tests.blackbox.harness import EXAMPLE, Process, environment, manage, wait_for

pytestmark = pytest.mark.postgresql

CHARGES = "/api/charges/"
# As the example's settings and its docs name them.
EXCHANGE = Exchange("payment-events", type="topic", durable=True)
QUEUE = Queue("payment-receipts", [binding(EXCHANGE, routing_key="payment.*")], durable=True)
# The inline runner's bound (docs/outbox.md, "Runners"), and what a charge takes besides.
INLINE_BOUND = 10.0
THE_CHARGE_ITSELF = 5.0


@pytest.fixture
def rabbitmq(tmp_path):
    if not rabbitmq_installed():
        pytest.fail("the broker fault tests need rabbitmq-server (Debian's package)")
    node = RabbitMQ(tmp_path / "rabbitmq")
    node.start()
    yield node
    node.delete()


def charge(server, description: str):
    body = json.dumps({"amount": 100, "currency": "eur", "description": description})
    # Far longer than the bound: a request held past it is seen, and timed, not cut short.
    key = description.replace(" ", "-")
    return server.send("POST", CHARGES, body.encode(), key=key, timeout=60)


def ready(url: str) -> int:
    """Messages in the receipts queue that no consumer holds."""
    with Connection(url) as connection:
        return int(QUEUE(connection.default_channel).queue_declare(passive=True).message_count)


def outbox(database) -> list[tuple[str, int, str]]:
    return database.execute(
        "SELECT status, attempts, last_error FROM django_idempotency_outboxmessage"
    )


def test_a_charge_answers_in_time_while_rabbitmq_blocks_publishing(
    rabbitmq, database, serve, tmp_path
):
    with Connection(rabbitmq.url) as connection:
        QUEUE(connection.default_channel).declare()
    knobs = {"PAYMENT_EVENTS_BROKER_URL": rabbitmq.url, "BLACKBOX_OUTBOX_RETRY_DELAY": "0.5"}
    server = serve(**knobs)
    before = charge(server, "before the alarm")
    assert before.status == 201, before
    assert outbox(database) == [("dispatched", 1, "")]
    # The relay's connection, still open, asks for heartbeats: RabbitMQ's default, 60 seconds.
    assert rabbitmq.ctl("list_connections", "--no-table-headers", "timeout").split() == ["60"]
    # Any memory in use is over the mark: the node blocks every connection that publishes.
    rabbitmq.ctl("set_vm_memory_high_watermark", "absolute", "1")
    wait_for(
        lambda: "memory" in rabbitmq.ctl("eval", "rabbit_alarm:get_alarms()."),
        timeout=10,
        what="the memory alarm",
    )

    answer = charge(server, "while blocked")

    print(f"the charge: {answer.status} in {answer.seconds:.2f} s; outbox:", outbox(database))
    assert answer.status == 201, answer
    assert answer.seconds < INLINE_BOUND + THE_CHARGE_ITSELF
    assert sorted(status for status, _, _ in outbox(database)) == ["dispatched", "pending"]

    rabbitmq.ctl("set_vm_memory_high_watermark", "0.4")
    wait_for(
        lambda: "memory" not in rabbitmq.ctl("eval", "rabbit_alarm:get_alarms()."),
        timeout=10,
        what="the memory alarm to clear",
    )
    env = environment(database, **knobs)

    def relayed() -> bool:
        manage(env, "idempotency_outbox", "--no-purge")
        return {status for status, _, _ in outbox(database)} == {"dispatched"}

    # Due again within the retry delay: a relay or two, as cron would run them.
    wait_for(relayed, timeout=30, interval=0.5, what="the periodic relay to send the event")
    consumer = Process(
        [
            sys.executable, str(EXAMPLE / "manage.py"), "idempotency_consume", QUEUE.name,
            "--broker", rabbitmq.url, "--exchange", EXCHANGE.name, "--routing-key", "payment.*",
            "--source", "payments",
        ],
        env=env,
        log=tmp_path / "consumer.log",
        cwd=EXAMPLE,
    )  # fmt: skip
    try:
        # Every copy the broker holds is consumed: a second one would be a duplicate, dropped.
        wait_for(
            lambda: database.count("payments_receiptemail") == 2 and ready(rabbitmq.url) == 0,
            timeout=30,
            interval=0.2,
            what="the receipt",
        )
    finally:
        consumer.stop()
    # One receipt for each payment.
    assert database.count("payments_receiptemail") == 2
    receipts = "SELECT count(DISTINCT payment_id) FROM payments_receiptemail"
    assert database.execute(receipts) == [(2,)]
    assert database.count("django_idempotency_inboxevent", "status = 'processed'") == 2
