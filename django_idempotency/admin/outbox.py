"""The outbox messages' admin page: messages redelivered with their ids, never deleted."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from django.contrib import admin
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin._base import _moment_column, _ReadOnlyAdmin, _short_id
from django_idempotency.models import OutboxMessage
from django_idempotency.outbox import redeliver

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


@admin.register(OutboxMessage)
class OutboxMessageAdmin(_ReadOnlyAdmin):
    list_display = [
        "short_message_id",
        "topic",
        "ordering_key",
        "status",
        "attempts",
        *(
            _moment_column(OutboxMessage, name)
            for name in ("created_at", "next_attempt_at", "dispatched_at")
        ),
    ]
    list_filter = ["status", "topic"]
    search_fields = ["message_id"]
    exact_search_field = "message_id"
    rows_name = _("messages")
    search_help_text = _("The exact message id.")
    actions = ["redeliver"]
    fieldsets = [
        (None, {"fields": ["message_id", "topic", "ordering_key", "status"]}),
        (_("Message"), {"fields": ["pretty_payload", "kept_headers"]}),
        (
            _("Dispatch"),
            {
                "fields": [
                    "attempts",
                    "created_at",
                    "next_attempt_at",
                    "dispatched_at",
                    "error",
                ]
            },
        ),
    ]

    def search_value(self, term: str) -> uuid.UUID | None:
        try:
            return uuid.UUID(term)
        except ValueError:
            return None  # a malformed id matches nothing

    @admin.display(description=_("message id"), ordering="message_id")
    def short_message_id(self, obj: OutboxMessage) -> str:
        return _short_id(str(obj.message_id))

    # A message deleted before it was sent is lost; the purge deletes the dispatched ones, so
    # the page deletes nothing.

    @admin.action(
        description=_("Redeliver the selected messages, with the same message ids"),
        permissions=["act"],
    )
    def redeliver(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        self._act(request, queryset, redeliver, _("Redelivered"))
