"""Message brokers, through kombu: an outbox that publishes, and consumers that handle each
message once.

:class:`BrokerDispatcher` publishes outbox messages to an exchange (with RabbitMQ's publisher
confirms); ``manage.py idempotency_consume`` runs :class:`MessageConsumer`, which records each
message in the inbox by its producer's id and runs its handler in the same transaction. Needs the
``brokers`` extra (kombu).
"""

from __future__ import annotations

from django_idempotency.brokers.consumer import MessageConsumer, consume, handle
from django_idempotency.brokers.publisher import BrokerDispatcher

__all__ = ["BrokerDispatcher", "MessageConsumer", "consume", "handle"]
