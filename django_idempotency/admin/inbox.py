"""The inbox events' admin page: events reprocessed, retried or marked dead, never deleted."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.utils.html import format_html
from django.utils.translation import gettext_lazy as _

from django_idempotency.admin._base import _moment_column, _ReadOnlyAdmin, _short_id
from django_idempotency.inbox import processing as inbox
from django_idempotency.models import InboxEvent

if TYPE_CHECKING:
    from django.db.models import QuerySet
    from django.http import HttpRequest


class ConflictFilter(admin.SimpleListFilter):
    """Events whose id was delivered again with another payload, which was kept apart."""

    title = _("conflict")
    parameter_name = "conflict"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Delivered again with another payload"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[InboxEvent]
    ) -> QuerySet[InboxEvent]:
        if self.value() == "yes":
            return queryset.filter(last_conflict_at__isnull=False)  # the conflict index
        return queryset


@admin.register(InboxEvent)
class InboxEventAdmin(_ReadOnlyAdmin):
    list_display = [
        "short_event_id",
        "source",
        "event_type",
        "status",
        "attempts",
        "deliveries",
        *(
            _moment_column(InboxEvent, name)
            # Not when it was processed: its status says whether, its page says when.
            for name in ("received_at", "last_delivered_at", "next_attempt_at")
        ),
    ]
    list_filter = ["status", "source", "event_type", ConflictFilter]
    search_fields = ["event_id"]
    exact_search_field = "event_id"  # the (source, event id) index serves it
    rows_name = _("events")
    search_help_text = _("The exact event id the sender gave.")
    actions = ["reprocess", "retry_now", "mark_dead"]
    fieldsets = [
        (None, {"fields": ["source", "event_id", "event_type", "status", "payload_hash"]}),
        (
            _("Delivery"),
            {
                "fields": [
                    "pretty_payload",
                    "kept_headers",
                    "deliveries",
                    "received_at",
                    "last_delivered_at",
                ]
            },
        ),
        (
            _("Processing"),
            {
                "fields": [
                    "attempts",
                    "next_attempt_at",
                    "processed_at",
                    "error",
                    "traceback",
                ]
            },
        ),
    ]

    # Shown on the page of an event that has had them: most have none.
    conflicts_fieldset: Any = (
        _("Conflicts"),
        {
            "fields": [
                "conflicts",
                "last_conflict_at",
                "pretty_conflicting_payload",
                "conflicting_payload_hash",
            ]
        },
    )

    def get_fieldsets(self, request: HttpRequest, obj: InboxEvent | None = None) -> Any:
        fieldsets = list(super().get_fieldsets(request, obj))
        if obj is not None and obj.conflicts:
            fieldsets.insert(2, self.conflicts_fieldset)
        return fieldsets

    # A deleted event would be processed again when its sender redelivers it: no deleting.

    @admin.display(description=_("event id"), ordering="event_id")
    def short_event_id(self, obj: InboxEvent) -> str:
        return _short_id(obj.event_id, shown=24)

    @admin.display(description=_("conflicting payload"))
    def pretty_conflicting_payload(self, obj: InboxEvent) -> str:
        if obj.conflicting_payload is None:
            return "—"
        text = json.dumps(obj.conflicting_payload, indent=2, ensure_ascii=False)
        return format_html("<pre>{}</pre>", text)

    @admin.display(description=_("last traceback"))
    def traceback(self, obj: InboxEvent) -> str:
        return format_html("<pre>{}</pre>", obj.last_traceback) if obj.last_traceback else "—"

    @admin.action(
        description=_("Reprocess the selected events from a clean slate"),
        permissions=["act"],
    )
    def reprocess(self, request: HttpRequest, queryset: QuerySet[InboxEvent]) -> None:
        # Events mid-attempt are left to finish.
        self._act(request, queryset, inbox.reprocess, _("Reprocessed"))

    @admin.action(description=_("Retry the selected failed events now"), permissions=["act"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[InboxEvent]) -> None:
        self._act(request, queryset, inbox.retry_now, _("Retried"))

    @admin.action(
        description=_("Mark the selected events dead: retry them no more"),
        permissions=["act"],
    )
    def mark_dead(self, request: HttpRequest, queryset: QuerySet[InboxEvent]) -> None:
        self._act(request, queryset, inbox.mark_dead, _("Marked dead"))
