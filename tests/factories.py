"""Rows in the states the library leaves them in, so that tests name a state, not its columns.

Each factory builds by default what a fresh write leaves: a key whose request is running, an
event just received, a message just published and due. Traits give the other states, as in
``IdempotencyKeyFactory(completed=True, expired=True)``; ``build()`` gives unsaved rows for
``bulk_create``.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import factory
import rfc8785
from django.contrib.auth import get_user_model
from django.utils import timezone

from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage

# Far enough on either side of "now" that a slow test never sees a row change state.
AGES_AGO = timedelta(days=31)
SOON = timedelta(minutes=1)


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.PostGenerationMethodCall("set_password", "password")

    @factory.post_generation
    def saved(obj, create, extracted, **kwargs):
        if create:
            obj.save()


def _ago(delta):
    return factory.LazyFunction(lambda: timezone.now() - delta)


def _ahead(delta):
    return factory.LazyFunction(lambda: timezone.now() + delta)


class IdempotencyKeyFactory(factory.django.DjangoModelFactory):
    """A key whose request is running, without a lease, that expires a day after it was made."""

    class Meta:
        model = IdempotencyKey

    scope = "user:1 POST payments/"
    key = factory.Sequence(lambda n: f"key-{n}")
    method = "POST"
    route = "payments/"
    fingerprint = "0" * 64
    state = IdempotencyKey.State.IN_PROGRESS
    created_at = factory.LazyFunction(timezone.now)
    expires_at = factory.LazyAttribute(lambda key: key.created_at + timedelta(hours=24))

    class Params:
        # The request finished and its JSON response is stored for replay.
        completed = factory.Trait(
            state=IdempotencyKey.State.SUCCEEDED,
            response_status=201,
            response_headers=[["Content-Type", "application/json"]],
            response_body=b'{"id": 1}',
            completed_at=factory.SelfAttribute("created_at"),
        )
        # Released after an error or a lost lease: the next request takes it over.
        failed = factory.Trait(state=IdempotencyKey.State.FAILED, locked_until=None)
        # Lease mode: a request holds the key for a while yet.
        leased = factory.Trait(state=IdempotencyKey.State.IN_PROGRESS, locked_until=_ahead(SOON))
        # Lease mode: the request holding the key died; a sweep marks it failed.
        lease_expired = factory.Trait(
            state=IdempotencyKey.State.IN_PROGRESS, locked_until=_ago(SOON)
        )
        # Made a day and an hour ago: expired an hour ago, so purged or taken over.
        expired = factory.Trait(created_at=_ago(timedelta(hours=25)))


def _payload_hash(event):
    return hashlib.sha256(rfc8785.dumps(event.payload)).hexdigest()


class InboxEventFactory(factory.django.DjangoModelFactory):
    """An event just received from the ``tests`` sender, due for processing within a minute."""

    class Meta:
        model = InboxEvent

    source = "tests"
    event_id = factory.Sequence(lambda n: f"evt_{n}")
    event_type = "customer.created"
    payload = factory.LazyAttribute(lambda event: {"id": event.event_id})
    payload_hash = factory.LazyAttribute(_payload_hash)
    status = InboxEvent.Status.RECEIVED
    attempts = 0
    received_at = factory.LazyFunction(timezone.now)
    next_attempt_at = factory.LazyAttribute(lambda event: event.received_at + SOON)

    class Params:
        # A worker has it: if the worker dies, the event is due again once its attempt times out.
        claimed = factory.Trait(
            status=InboxEvent.Status.PROCESSING, attempts=1, next_attempt_at=_ahead(SOON)
        )
        processed = factory.Trait(
            status=InboxEvent.Status.PROCESSED,
            attempts=1,
            next_attempt_at=None,
            processed_at=factory.SelfAttribute("received_at"),
        )
        # Its first attempt raised; it is retried later.
        failed = factory.Trait(
            status=InboxEvent.Status.FAILED,
            attempts=1,
            next_attempt_at=_ahead(SOON),
            last_error="RuntimeError: the handler failed",
        )
        # Out of attempts: it waits for a person.
        dead = factory.Trait(
            status=InboxEvent.Status.DEAD,
            attempts=10,
            next_attempt_at=None,
            last_error="RuntimeError: the handler failed",
        )
        # Processed long enough ago to be purged.
        old = factory.Trait(processed=True, received_at=_ago(AGES_AGO))


class OutboxMessageFactory(factory.django.DjangoModelFactory):
    """A message just published and due for dispatch."""

    class Meta:
        model = OutboxMessage

    topic = "tests.recorded"
    payload = factory.Sequence(lambda n: {"n": n})
    status = OutboxMessage.Status.PENDING
    created_at = factory.LazyFunction(timezone.now)
    next_attempt_at = factory.SelfAttribute("created_at")

    class Params:
        # Waiting for a retry, or published for later.
        scheduled = factory.Trait(next_attempt_at=_ahead(timedelta(hours=1)))
        # A relay has it, until its lease runs out.
        claimed = factory.Trait(attempts=1, next_attempt_at=_ahead(SOON))
        sent = factory.Trait(
            status=OutboxMessage.Status.DISPATCHED,
            attempts=1,
            next_attempt_at=None,
            dispatched_at=factory.SelfAttribute("created_at"),
        )
        # Out of attempts: it waits for a person.
        dead = factory.Trait(
            status=OutboxMessage.Status.DEAD,
            attempts=10,
            next_attempt_at=None,
            last_error="ConnectionError: the consumer is down",
        )
