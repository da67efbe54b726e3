"""How a message leaves: one dispatcher per topic.

A dispatcher is any callable that takes the ``OutboxMessage`` and returns once the message is
delivered; it raises to fail the attempt, which is then retried. It may be called more than once
for a message (at-least-once delivery): every call carries the same ``message_id``, which the
consumer dedupes on. A dispatcher that sends several messages faster than one by one (a broker's
publisher confirms awaited together) offers ``dispatch_many(messages)`` as well, which returns,
for each message in order, ``None`` once it is delivered or the exception that fails its attempt:
the relay then hands it all its batch's messages at once.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.serializers.json import DjangoJSONEncoder

from django_idempotency.core import correlation, optional, task_sending
from django_idempotency.exceptions import PermanentError
from django_idempotency.signing import StandardWebhooksSignature

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import httpx

    from django_idempotency.client import RetryPolicy
    from django_idempotency.models import OutboxMessage

    Dispatcher = Callable[[OutboxMessage], object]
    #: Why a message was not delivered, or ``None`` once it is.
    Outcome = Exception | None
    Secrets = str | bytes | Sequence[str | bytes]

#: Registers a dispatcher for every topic that has none of its own.
ANY_TOPIC = "*"

_registry: dict[str, Dispatcher] = {}


class DispatchError(Exception):
    """The consumer did not accept the message; the attempt is retried."""


class PermanentDispatchError(DispatchError, PermanentError):
    """The consumer refused the message for good: the message is dead at once."""


# A consumer's 4xx answers the same to every retry, but for these, which invite one.
RETRYABLE_REFUSALS = frozenset({408, 409, 425, 429})


def register_dispatcher(topic: str, dispatcher: Dispatcher) -> None:
    """Dispatch the messages of ``topic`` (or of ``ANY_TOPIC``) with ``dispatcher``."""
    current = _registry.get(topic)
    if current is not None and current is not dispatcher:
        msg = f"Topic {topic!r} has a dispatcher already: {current!r}."
        raise ImproperlyConfigured(msg)
    _registry[topic] = dispatcher


def outbox_dispatcher(*topics: str) -> Callable[[Dispatcher], Dispatcher]:
    """Register the decorated function as the dispatcher of ``topics``."""
    if not topics:
        msg = "outbox_dispatcher() needs the topics it dispatches, or ANY_TOPIC."
        raise TypeError(msg)

    def register(dispatcher: Dispatcher) -> Dispatcher:
        for topic in topics:
            register_dispatcher(topic, dispatcher)
        return dispatcher

    return register


def get_dispatcher(topic: str) -> Dispatcher | None:
    """The dispatcher of ``topic``'s messages, if one is registered."""
    return _registry.get(topic) or _registry.get(ANY_TOPIC)


def dispatch_units(
    messages: Sequence[OutboxMessage],
) -> list[tuple[Dispatcher | None, list[OutboxMessage]]]:
    """Split ``messages`` into what is dispatched in one go: all those of a dispatcher that
    offers ``dispatch_many``, and each other message alone; in the order of their first message.

    The order within a relay's batch does not matter across ordering keys, and the batch holds
    one message at most of each key: the next waits until that one is sent.
    """
    units: list[tuple[Dispatcher | None, list[OutboxMessage]]] = []
    together: dict[int, list[OutboxMessage]] = {}
    for message in messages:
        dispatcher = get_dispatcher(message.topic)
        if not callable(getattr(dispatcher, "dispatch_many", None)):
            units.append((dispatcher, [message]))
        elif (same := together.get(id(dispatcher))) is not None:
            same.append(message)
        else:
            together[id(dispatcher)] = [message]
            units.append((dispatcher, together[id(dispatcher)]))
    return units


def dispatch(dispatcher: Dispatcher | None, messages: list[OutboxMessage]) -> list[Outcome]:
    """Dispatch ``messages`` with ``dispatcher``, at once if it offers ``dispatch_many``;
    return each one's outcome. The dispatcher's errors are data: recorded, then retried."""
    many = getattr(dispatcher, "dispatch_many", None)
    if many is None:
        return [_dispatch_one(dispatcher, message) for message in messages]
    try:
        outcomes = list(many(messages))
        if len(outcomes) != len(messages):
            msg = f"{dispatcher!r} answered for {len(outcomes)} of {len(messages)} messages."
            raise TypeError(msg)
    except Exception as exc:  # the attempt of every message fails
        return [exc] * len(messages)
    # Whatever is not None leaves its message to retry: none is marked sent unless it says so.
    return [
        outcome if outcome is None or isinstance(outcome, Exception) else DispatchError(outcome)
        for outcome in outcomes
    ]


def _dispatch_one(dispatcher: Dispatcher | None, message: OutboxMessage) -> Outcome:
    try:
        if dispatcher is None:
            msg = f"No outbox dispatcher is registered for the topic {message.topic!r}."
            raise LookupError(msg)  # retried: a deploy may bring the dispatcher
        dispatcher(message)
    except Exception as exc:  # recorded as the attempt's failure
        return exc
    return None


def unregister(*topics: str) -> None:
    """Forget the dispatchers of ``topics``: for tests."""
    for topic in topics:
        _registry.pop(topic, None)


def envelope(message: OutboxMessage) -> dict[str, Any]:
    """The body a message is sent as: the shape the inbox's receiver reads by default."""
    return {
        "id": str(message.message_id),
        "type": message.topic,
        "created": message.created_at.isoformat(),
        "data": message.payload,
    }


class WebhookDispatcher:
    """POST each message to ``url`` as JSON, signed the Standard Webhooks way.

    The message id goes in the body's ``id``, the ``webhook-id`` header and the
    ``Idempotency-Key`` header, so the consumer can dedupe each way. A 2xx answer delivers the
    message. Needs httpx and the ``client`` extra: short network failures are retried at once by
    the retry client, longer ones by the outbox's schedule. The retry client waits no longer than
    the relay has left (``guard.remaining()``), unless its policy does not ``propagate``.
    """

    def __init__(
        self,
        url: str | Callable[[], str],
        secrets: Secrets | Callable[[], Secrets],
        *,
        timeout: float = 10.0,
        policy: RetryPolicy | None = None,
    ) -> None:
        self.url = url
        self.signer = StandardWebhooksSignature(secrets)
        self.timeout = timeout
        self.policy = policy
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"WebhookDispatcher({self.url!r})"

    def __call__(self, message: OutboxMessage) -> None:
        body = json.dumps(envelope(message), cls=DjangoJSONEncoder).encode()
        message_id = str(message.message_id)
        headers = {
            **message.headers,
            "Content-Type": "application/json",
            "Idempotency-Key": message_id,
            **self.signer.sign(body, msg_id=message_id),
        }
        url = self.url() if callable(self.url) else self.url
        response = self.client.post(url, content=body, headers=headers)
        if not response.is_success:
            msg = f"{url} answered {response.status_code}"
            status = response.status_code
            if 400 <= status < 500 and status not in RETRYABLE_REFUSALS:
                raise PermanentDispatchError(msg)
            raise DispatchError(msg)

    @property
    def client(self) -> httpx.Client:
        # One client per thread: its connections are reused from one message to the next.
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            if not optional.installed("httpx"):
                msg = (
                    "WebhookDispatcher needs httpx, not installed: "
                    'pip install "django-idempotency[client]" httpx'
                )
                raise ImproperlyConfigured(msg)
            import httpx  # noqa: PLC0415 - an optional dependency

            # The retry client imports tenacity, of the client extra.
            from django_idempotency.client import RetryPolicy, RetryTransport  # noqa: PLC0415

            transport = RetryTransport(policy=self.policy or RetryPolicy())
            client = httpx.Client(transport=transport, timeout=self.timeout)
            self._local.client = client
        return client


class CeleryTaskDispatcher:
    """Send each message's payload to the Celery task ``task_name``.

    The task receives ``payload`` and ``message_id`` as keyword arguments; the message id is
    also the task id. Celery delivers at least once too: make the task dedupe on it. The
    message's correlation id goes with it as the ``X-Correlation-ID`` message header, which an
    ``@idempotent_task`` binds while it runs (a plain task finds it in ``self.request``).
    """

    def __init__(self, task_name: str, *, queue: str | None = None) -> None:
        self.task_name = task_name
        self.queue = queue

    def __repr__(self) -> str:
        return f"CeleryTaskDispatcher({self.task_name!r})"

    def __call__(self, message: OutboxMessage) -> None:
        options: dict[str, Any] = {}
        if (correlation_id := correlation.from_headers(message.headers)) is not None:
            options["headers"] = {correlation.HEADER: correlation_id}
        task_sending.send_task(
            self.task_name,
            needed_by="CeleryTaskDispatcher",
            kwargs={"payload": message.payload, "message_id": str(message.message_id)},
            task_id=str(message.message_id),
            queue=self.queue,
            **options,
        )
