"""``manage.py idempotency_consume``: consume a broker's queue, each message handled once."""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_idempotency.core import optional


class Command(BaseCommand):
    help = (
        "Consume QUEUE on the broker at --broker until SIGTERM or SIGINT: each message is "
        "recorded in the inbox by its message_id, as an event of --source, and handled by that "
        "source's inbox handlers in the same transaction, then acknowledged."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queue", help="The queue to consume; declared if missing (durable).")
        parser.add_argument(
            "--broker",
            required=True,
            help="The broker's URL, as kombu reads it: amqp://..., redis://..., sqs://...",
        )
        parser.add_argument(
            "--source", help="The inbox source its events are recorded as (default: the queue)."
        )
        parser.add_argument(
            "--exchange",
            help="Bind the queue to this topic exchange (declared if missing, durable).",
        )
        parser.add_argument(
            "--routing-key",
            action="append",
            help="With --exchange: a binding key; repeat for more (default: #, every message).",
        )
        parser.add_argument(
            "--prefetch",
            type=int,
            default=10,
            help="Unacknowledged messages the broker hands each consumer at once (10).",
        )
        parser.add_argument(
            "--concurrency", type=int, default=1, help="Consumers, one thread each (1)."
        )
        parser.add_argument(
            "--queue-argument",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=(
                "An argument the queue is declared with, the value read as JSON if it can be; "
                "repeat for more. A quorum queue, as RabbitMQ recommends for messages that "
                "matter: x-queue-type=quorum. They must be those the queue has, if it exists."
            ),
        )
        parser.add_argument(
            "--transport-option",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=(
                "An option of kombu's transport, the value read as JSON if it can be; repeat for "
                "more. On Redis and SQS: visibility_timeout=SECONDS, how long a message whose "
                "consumer died stays hidden (kombu's default: an hour)."
            ),
        )

    def handle(
        self,
        *args: Any,
        queue: str,
        broker: str,
        source: str | None,
        exchange: str | None,
        routing_key: list[str] | None,
        prefetch: int,
        concurrency: int,
        queue_argument: list[str],
        transport_option: list[str],
        **options: Any,
    ) -> None:
        if not optional.installed("kombu"):
            raise CommandError(str(optional.missing("brokers", "idempotency_consume")))
        if prefetch < 1 or concurrency < 1:
            msg = "--prefetch and --concurrency must be at least 1."
            raise CommandError(msg)
        from kombu import Exchange, Queue, binding  # noqa: PLC0415 - an optional dependency

        # They import kombu.
        from django_idempotency.brokers import consume  # noqa: PLC0415
        from django_idempotency.brokers.consumer import QueueRefused, check_source  # noqa: PLC0415

        source = source or queue
        try:
            check_source(source)
        except ValueError as exc:
            raise CommandError(f"--source: {exc}") from None
        arguments = dict(_option(given, "--queue-argument") for given in queue_argument)
        if exchange:
            topic = Exchange(exchange, type="topic", durable=True)
            bindings = [binding(topic, routing_key=key) for key in routing_key or ["#"]]
        elif routing_key:
            msg = "--routing-key needs --exchange."
            raise CommandError(msg)
        else:
            bindings = []
        queues = [Queue(queue, bindings=bindings, durable=True, queue_arguments=arguments or None)]
        transport_options = dict(_option(given, "--transport-option") for given in transport_option)
        stop = threading.Event()

        def ask_to_stop(signum: int, frame: object) -> None:
            # The message in hand is finished first; those prefetched go back to the queue.
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, ask_to_stop)
        self.stdout.write(f"Consuming {queue} as {source} ({concurrency} consumers).")
        try:
            consume(
                broker,
                queues,
                source=source,
                prefetch=prefetch,
                concurrency=concurrency,
                transport_options=transport_options,
                stop=stop,
            )
        except QueueRefused as exc:
            # Not a fault a restart mends: say why, and let the operator fix the declaration.
            hint = "Declare it with the queue's own arguments: --queue-argument NAME=VALUE."
            raise CommandError(f"{exc}. {hint}") from None
        self.stdout.write("Stopped.")


def _option(given: str, option: str) -> tuple[str, Any]:
    name, equals, value = given.partition("=")
    if not equals or not name:
        msg = f"{option} {given!r}: NAME=VALUE"
        raise CommandError(msg)
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value
