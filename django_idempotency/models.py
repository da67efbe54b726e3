from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from django_idempotency.core.tables import ROUTE_LENGTH, SCOPE_LENGTH

# The managers work on the model they manage, and import nothing of this module.
from django_idempotency.managers import (
    IdempotencyKeyManager,
    InboxEventQuerySet,
    OutboxMessageQuerySet,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["IdempotencyKey", "InboxEvent", "OutboxMessage"]


class PartialIndex(models.Index):
    """An index on the rows ``where`` matches, on databases with partial indexes.

    PostgreSQL and SQLite build it partial. MariaDB has no partial indexes: it gets the index on
    every row, as Django's own ``condition`` would give it, without the warning (models.W037)
    that ``condition`` makes every MariaDB ``migrate`` print.
    """

    def __init__(self, *, where: models.Q, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where = where

    def deconstruct(self) -> tuple[str, Sequence[Any], dict[str, Any]]:
        path, args, kwargs = super().deconstruct()
        return path, args, {**kwargs, "where": self.where}

    def create_sql(self, model: Any, schema_editor: Any, using: str = "", **kwargs: Any) -> Any:
        index = models.Index(fields=self.fields, name=self.name)
        if schema_editor.connection.features.supports_partial_indexes:
            index = models.Index(fields=self.fields, name=self.name, condition=self.where)
        return index.create_sql(model, schema_editor, using=using, **kwargs)


class IdempotencyKey(models.Model):
    """One idempotency key, its request fingerprint and, once completed, the stored response."""

    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", _("in progress")
        SUCCEEDED = "succeeded", _("succeeded")
        FAILED = "failed", _("failed")

    # A key table churns fast: a 32-bit key would run out.
    id = models.BigAutoField(primary_key=True)
    scope = models.CharField(
        _("scope"),
        max_length=SCOPE_LENGTH,
        help_text=_("Who sent the key and to which operation: principal, method and route."),
    )
    key = models.CharField(_("key"), max_length=255)
    method = models.CharField(_("method"), max_length=10)
    route = models.CharField(_("route"), max_length=ROUTE_LENGTH, help_text=_("The URL pattern."))
    fingerprint = models.CharField(
        _("fingerprint"), max_length=64, help_text=_("SHA-256 of the request.")
    )
    state = models.CharField(
        _("state"), max_length=16, choices=State.choices, default=State.IN_PROGRESS
    )
    lease_version = models.PositiveBigIntegerField(
        _("lease version"),
        default=1,
        help_text=_("Fencing token: raised each time another request takes the key over."),
    )
    locked_until = models.DateTimeField(
        _("locked until"),
        null=True,
        blank=True,
        help_text=_("Lease mode: until when the request running the key owns it."),
    )
    attempts = models.PositiveIntegerField(
        _("attempts"),
        default=1,
        help_text=_("Requests that started running this key; above 1 after an unfinished one."),
    )
    response_status = models.PositiveSmallIntegerField(_("response status"), null=True, blank=True)
    response_headers = models.JSONField(
        _("response headers"),
        null=True,
        blank=True,
        help_text=_("The stored response's headers as [name, value] pairs, in order."),
    )
    response_body = models.BinaryField(_("response body"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"))
    completed_at = models.DateTimeField(_("completed at"), null=True, blank=True)
    expires_at = models.DateTimeField(_("expires at"))
    replay_count = models.PositiveIntegerField(_("replay count"), default=0)
    unsettled_lease_version = models.PositiveBigIntegerField(
        _("unsettled lease version"),
        null=True,
        blank=True,
        help_text=_(
            "The lease that the reconcile hook could not settle: while the key is still at this "
            "lease version, it waits for a person."
        ),
    )
    last_replayed_at = models.DateTimeField(_("last replayed at"), null=True, blank=True)

    objects = IdempotencyKeyManager["IdempotencyKey"]()

    class Meta:
        verbose_name = _("idempotency key")
        verbose_name_plural = _("idempotency keys")
        constraints = [
            # The only arbiter of races between duplicates: see core/store.py. The key leads, so the
            # admin's search by key uses this index too.
            models.UniqueConstraint(fields=["key", "scope"], name="idempotency_scope_key_uniq"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idempotency_expires_idx"),
            # Only leased rows carry locked_until. Keying the index on it rather than on the
            # state keeps completing a key (which changes the state) a HOT update.
            PartialIndex(
                fields=["locked_until"],
                name="idempotency_lease_idx",
                where=models.Q(locked_until__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.method} {self.route})"


class InboxEvent(models.Model):
    """A webhook event as delivered, and how its processing went."""

    class Status(models.TextChoices):
        RECEIVED = "received", _("received")
        PROCESSING = "processing", _("processing")
        PROCESSED = "processed", _("processed")
        FAILED = "failed", _("failed")
        DEAD = "dead", _("dead")

    # An inbox churns fast: a 32-bit key would run out.
    id = models.BigAutoField(primary_key=True)
    source = models.CharField(
        _("source"), max_length=100, help_text=_("The sender, as its receiver view names it.")
    )
    event_id = models.CharField(
        _("event id"),
        max_length=255,
        help_text=_(
            "The sender's id of the event; for a sender that gives none, the payload hash."
        ),
    )
    event_type = models.CharField(_("event type"), max_length=255, blank=True)
    payload = models.JSONField(_("payload"))
    payload_hash = models.CharField(
        _("payload hash"),
        max_length=64,
        help_text=_("SHA-256 of the payload's canonical JSON (RFC 8785)."),
    )
    headers = models.JSONField(
        _("headers"), default=dict, blank=True, help_text=_("Request headers kept with the event.")
    )
    status = models.CharField(
        _("status"), max_length=16, choices=Status.choices, default=Status.RECEIVED
    )
    attempts = models.PositiveIntegerField(
        _("attempts"), default=0, help_text=_("Processing attempts started, the current included.")
    )
    received_at = models.DateTimeField(_("received at"), default=timezone.now)
    deliveries = models.PositiveIntegerField(
        _("deliveries"),
        default=1,
        help_text=_("Times the sender delivered the event, duplicates included."),
    )
    last_delivered_at = models.DateTimeField(
        _("last delivered at"),
        null=True,
        blank=True,
        help_text=_("When the last duplicate delivery arrived; empty if none did."),
    )
    next_attempt_at = models.DateTimeField(
        _("next attempt at"),
        null=True,
        blank=True,
        help_text=_(
            "When the event is due for another attempt if this one does not finish; empty once "
            "it is processed or dead."
        ),
    )
    processed_at = models.DateTimeField(_("processed at"), null=True, blank=True)
    last_error = models.TextField(_("last error"), blank=True)
    last_traceback = models.TextField(_("last traceback"), blank=True)
    # The database's own defaults: the inbox's INSERT (inbox/receiving.py) names only the columns
    # a new event needs.
    conflicts = models.PositiveIntegerField(
        _("conflicts"),
        db_default=0,
        help_text=_(
            "Deliveries of the event's id with another payload: kept apart, never processed."
        ),
    )
    last_conflict_at = models.DateTimeField(
        _("last conflict at"),
        null=True,
        blank=True,
        help_text=_("When the last delivery with another payload arrived."),
    )
    conflicting_payload = models.JSONField(
        _("conflicting payload"),
        null=True,
        blank=True,
        help_text=_("The payload of the last delivery with another payload."),
    )
    conflicting_payload_hash = models.CharField(
        _("conflicting payload hash"), max_length=64, blank=True, db_default=""
    )

    objects = InboxEventQuerySet["InboxEvent"].as_manager()

    class Meta:
        verbose_name = _("inbox event")
        verbose_name_plural = _("inbox events")
        constraints = [
            # The only arbiter between duplicate deliveries: see inbox/receiving.py.
            models.UniqueConstraint(
                fields=["source", "event_id"], name="idempotency_inbox_event_uniq"
            ),
        ]
        indexes = [
            # Only events still to be processed carry next_attempt_at: the periodic run's
            # query reads this small index and nothing else.
            PartialIndex(
                fields=["next_attempt_at"],
                name="idempotency_inbox_due_idx",
                where=models.Q(next_attempt_at__isnull=False),
            ),
            PartialIndex(
                fields=["processed_at"],
                name="idempotency_inbox_done_idx",
                where=models.Q(status="processed"),
            ),
            # Dead events are few and wait for a person: the metrics count them from here.
            PartialIndex(
                fields=["received_at"],
                name="idempotency_inbox_dead_idx",
                where=models.Q(status="dead"),
            ),
            # So are events delivered again with another payload: the admin filters them here.
            PartialIndex(
                fields=["last_conflict_at"],
                name="idempotency_inbox_conflict_idx",
                where=models.Q(last_conflict_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.source} {self.event_id}"


class OutboxMessage(models.Model):
    """A message published in a transaction, waiting to be dispatched once that commits."""

    class Status(models.TextChoices):
        PENDING = "pending", _("pending")
        DISPATCHED = "dispatched", _("dispatched")
        DEAD = "dead", _("dead")

    # An outbox churns fast: a 32-bit key would run out.
    id = models.BigAutoField(primary_key=True)
    message_id = models.UUIDField(
        _("message id"),
        unique=True,
        default=uuid.uuid4,
        editable=False,
        help_text=_("Sent with every delivery of the message, so that its consumer can dedupe."),
    )
    topic = models.CharField(
        _("topic"), max_length=255, help_text=_("What the message is about; picks its dispatcher.")
    )
    payload = models.JSONField(_("payload"))
    headers = models.JSONField(_("headers"), default=dict, blank=True)
    ordering_key = models.CharField(
        _("ordering key"),
        max_length=255,
        blank=True,
        default="",
        help_text=_("Messages with the same key are dispatched one at a time, oldest first."),
    )
    status = models.CharField(
        _("status"), max_length=16, choices=Status.choices, default=Status.PENDING
    )
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    created_at = models.DateTimeField(_("created at"), default=timezone.now)
    next_attempt_at = models.DateTimeField(
        _("next attempt at"),
        null=True,
        blank=True,
        help_text=_("When the message is due for dispatch; empty once dispatched or dead."),
    )
    dispatched_at = models.DateTimeField(_("dispatched at"), null=True, blank=True)
    last_error = models.TextField(_("last error"), blank=True)

    objects = OutboxMessageQuerySet["OutboxMessage"].as_manager()

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        indexes = [
            # The relay's claim reads only pending messages, oldest due first.
            PartialIndex(
                fields=["next_attempt_at", "id"],
                name="idempotency_outbox_due_idx",
                where=models.Q(status="pending"),
            ),
            # "Is an older message with this key still pending?", asked for each candidate.
            PartialIndex(
                fields=["ordering_key", "id"],
                name="idempotency_outbox_order_idx",
                where=models.Q(status="pending") & ~models.Q(ordering_key=""),
            ),
            PartialIndex(
                fields=["dispatched_at"],
                name="idempotency_outbox_done_idx",
                where=models.Q(status="dispatched"),
            ),
            # Dead messages too.
            PartialIndex(
                fields=["created_at"],
                name="idempotency_outbox_dead_idx",
                where=models.Q(status="dead"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.topic} {self.message_id}"
