"""The Django admin: idempotency keys, inbox events, outbox messages. Look, never edit; act through
actions, each of which is logged in the admin's history."""

from __future__ import annotations

import json
import uuid
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import router
from django.shortcuts import redirect
from django.urls import path
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_POST

from django_idempotency.conf import TASK_METHOD, UNSAFE_METHODS
from django_idempotency.inbox import processing as inbox
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from django_idempotency.outbox import redeliver
from django_idempotency.reconcile import NEEDS_ATTENTION
from django_idempotency.store import KeyStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.db.models import QuerySet
    from django.http import HttpRequest, HttpResponse
    from django.urls import URLPattern
    from django.utils.functional import _StrPromise

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
else:
    # Not subscriptable at run time.
    _ModelAdmin = admin.ModelAdmin

# Larger stored bodies are summarised rather than shown.
SHOWN_BODY_BYTES = 64 * 1024
# How long the admin's "purge all expired keys" may run within its request.
PURGE_SECONDS = 10.0


class ExpiredFilter(admin.SimpleListFilter):
    title = _("expired")
    parameter_name = "expired"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        # No "No": on a large table of live keys it would walk the expiry index end to end.
        return [("yes", _("Yes"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> QuerySet[IdempotencyKey]:
        if self.value() == "yes":
            return queryset.filter(expires_at__lte=timezone.now())
        return queryset


class StuckLeaseFilter(admin.SimpleListFilter):
    title = _("lease")
    parameter_name = "lease"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("held", _("Held")), ("expired", _("Expired (stuck)"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> QuerySet[IdempotencyKey]:
        # Only leased, unfinished keys carry locked_until: both use the lease index.
        if self.value() == "held":
            return queryset.filter(locked_until__gt=timezone.now())
        if self.value() == "expired":
            return queryset.filter(locked_until__lte=timezone.now())
        return queryset


class NeedsAttentionFilter(admin.SimpleListFilter):
    # Keys the sweeper's reconcile hook could not settle: see django_idempotency.reconcile.
    title = _("needs attention")
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("yes", _("Unsettled by the reconcile hook"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> QuerySet[IdempotencyKey]:
        return queryset.filter(NEEDS_ATTENTION) if self.value() == "yes" else queryset


class MethodFilter(admin.SimpleListFilter):
    # A fixed list: the default filter would read every row for the distinct methods.
    title = _("method")
    parameter_name = "method"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        methods = [(method, method) for method in sorted(UNSAFE_METHODS)]
        return [*methods, (TASK_METHOD, _("Celery task"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> QuerySet[IdempotencyKey]:
        return queryset.filter(method=self.value()) if self.value() else queryset


def _header_table(headers: dict[str, str]) -> str:
    if not headers:
        return "—"
    rows = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", headers.items())
    return format_html("<table>{}</table>", rows)


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """Counts at most ``CAP`` rows: a full count of a busy key table would read all of it."""

    CAP = 10_000

    @cached_property
    def count(self) -> int:
        return int(self.object_list[: self.CAP].count())  # type: ignore[attr-defined]


class _ReadOnlyAdmin(_ModelAdmin):
    """What the three pages share: large tables, read-only rows, exact search, logged actions."""

    paginator = CappedPaginator
    ordering = ["-id"]
    # A count of a large, busy table is a full scan; the pager does without it.
    show_full_result_count = False
    list_per_page = 50
    # The one field the search box matches exactly: only an exact match can use its index
    # (the default search would scan every row).
    exact_search_field = "id"
    # What the actions' messages call the rows: "Retried 1 of the 3 selected events."
    rows_name: str | _StrPromise = _("rows")

    def search_value(self, term: str) -> Any:
        """The value of ``exact_search_field`` that ``term`` names; ``None`` matches nothing."""
        return term

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        value = self.search_value(term)
        if value is None:
            return queryset.none(), False
        return queryset.filter(**{self.exact_search_field: value}), False

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # What a client was told, what arrived, what left: evidence, so nothing is editable.
        return [
            str(field) for _name, options in self.fieldsets or [] for field in options["fields"]
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the view permission still shows every page

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description=_("payload"))
    def pretty_payload(self, obj: Any) -> str:
        return format_html("<pre>{}</pre>", json.dumps(obj.payload, indent=2, ensure_ascii=False))

    @admin.display(description=_("headers"))
    def kept_headers(self, obj: Any) -> str:
        return _header_table(obj.headers)

    def _act(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        action: Callable[[QuerySet[Any]], list[int]],
        done: str | _StrPromise,
    ) -> None:
        """Run ``action`` on the selected rows, log each row it changed, and say how many."""
        selected = {row.pk: row for row in queryset}
        acted_on = action(self.model.objects.filter(pk__in=selected))
        for pk in acted_on:
            self.log_change(request, selected[pk], done)
        self.message_user(
            request,
            _("%(done)s %(count)d of the %(selected)d selected %(rows)s.")
            % {
                "done": done,
                "count": len(acted_on),
                "selected": len(selected),
                "rows": self.rows_name,
            },
            messages.SUCCESS,
        )


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(_ReadOnlyAdmin):
    # The scope names the principal as well as the method and route: one key may serve several.
    list_display = [
        "key",
        "scope",
        "state",
        "response_status",
        "created_at",
        "expires_at",
        "replay_count",
    ]
    # Dates by expiry, as ranges the expiry index serves. Not date_hierarchy: it lists the
    # distinct days by reading every row (half a second at 1,000,000 keys). Not by creation:
    # that would need one more index, updated by every request.
    list_filter = [
        "state",
        ExpiredFilter,
        StuckLeaseFilter,
        NeedsAttentionFilter,
        MethodFilter,
        ("expires_at", admin.DateFieldListFilter),
    ]
    search_fields = ["key"]
    # Case-sensitive: a key is an opaque token.
    exact_search_field = "key"
    search_help_text = _("The exact Idempotency-Key.")
    actions = ["release_expired_leases", "delete_expired"]
    fieldsets = [
        (None, {"fields": ["key", "scope", "method", "route", "state", "fingerprint"]}),
        (
            _("Stored response"),
            {"fields": ["response_status", "stored_headers", "stored_body"]},
        ),
        (
            _("Timings"),
            {
                "fields": [
                    "created_at",
                    "completed_at",
                    "expires_at",
                    "locked_until",
                    "lease_version",
                    "attempts",
                    "replay_count",
                    "last_replayed_at",
                ]
            },
        ),
    ]

    def get_urls(self) -> list[URLPattern]:
        purge = path(
            "purge-expired/",
            self.admin_site.admin_view(self.purge_expired_view),
            name="django_idempotency_idempotencykey_purge_expired",
        )
        return [purge, *super().get_urls()]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra_context = {
            **(extra_context or {}),
            "has_delete_permission": self.has_delete_permission(request),
        }
        return super().changelist_view(request, extra_context)

    @method_decorator(require_POST)
    def purge_expired_view(self, request: HttpRequest) -> HttpResponse:
        """Delete every expired key, as the purge task does, for at most ``PURGE_SECONDS``."""
        if not self.has_delete_permission(request):
            raise PermissionDenied
        result = IdempotencyKey.objects.purge_expired(max_seconds=PURGE_SECONDS)
        LogEntry.objects.create(
            user_id=cast("int", request.user.pk),  # admin_view() let only staff in
            content_type=ContentType.objects.get_for_model(IdempotencyKey),
            object_repr=f"{result.deleted} expired keys",
            action_flag=DELETION,
            change_message=f"Purged {result.deleted} expired keys.",
        )
        message = _("Purged %(count)d expired keys.") % {"count": result.deleted}
        if not result.complete:
            message += " " + str(_("Time ran out: run it again, or let the purge task finish."))
        self.message_user(request, message, messages.SUCCESS)
        return redirect("admin:django_idempotency_idempotencykey_changelist")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Deleting a live key would let the next retry run its effect again.
        expired = obj is None or obj.expires_at <= timezone.now()
        return expired and _ModelAdmin.has_delete_permission(self, request, obj)

    # Django 6.1 passes where the actions are shown (action_location) to an override that names
    # the parameter, and deprecates one that does not; Django 5.2 passes nothing.
    def get_actions(self, request: HttpRequest, action_location: Any = None) -> dict[str, Any]:
        location = () if action_location is None else (action_location,)
        actions = super().get_actions(request, *location)
        actions.pop("delete_selected", None)  # it would delete live keys too
        return actions

    @admin.display(description=_("headers"))
    def stored_headers(self, obj: IdempotencyKey) -> str:
        if not obj.response_headers:
            return "—"
        rows = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", obj.response_headers)
        return format_html("<table>{}</table>", rows)

    @admin.display(description=_("body"))
    def stored_body(self, obj: IdempotencyKey) -> str:
        if obj.response_body is None:
            return "—"
        body = bytes(obj.response_body)
        content_type = dict(obj.response_headers or []).get("Content-Type", "")
        if len(body) <= SHOWN_BODY_BYTES and "json" in content_type:
            try:
                pretty = json.dumps(json.loads(body), indent=2, ensure_ascii=False)
            except ValueError:
                pass
            else:
                return format_html("<pre>{}</pre>", pretty)
        if len(body) <= SHOWN_BODY_BYTES and content_type.startswith("text/"):
            return format_html("<pre>{}</pre>", body.decode(errors="replace"))
        return format_html("{} ({} bytes)", content_type or _("no content type"), f"{len(body):,}")

    def has_release_permission(self, request: HttpRequest) -> bool:
        # The model's change permission: the pages stay read-only, the lease can be released.
        return bool(request.user.has_perm("django_idempotency.change_idempotencykey"))

    @admin.action(description=_("Release the selected expired leases"), permissions=["release"])
    def release_expired_leases(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> None:
        # What the sweeper does, to the selected keys only.
        now = timezone.now()
        stuck = list(queryset.filter(locked_until__lte=now))
        store = KeyStore(router.db_for_write(IdempotencyKey))
        count = store.release_expired(now, limit=len(stuck), ids=[key.pk for key in stuck])
        for key in stuck:
            self.log_change(request, key, "Released its expired lease.")
        self.message_user(
            request,
            _("Released %(count)d expired leases; live ones were kept.") % {"count": count},
            messages.SUCCESS,
        )

    @admin.action(
        description=_("Delete the selected keys that have expired"), permissions=["delete"]
    )
    def delete_expired(self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]) -> None:
        expired = queryset.filter(expires_at__lte=timezone.now())
        self.log_deletions(request, expired)
        count, _deleted = expired.delete()
        self.message_user(
            request,
            _("Deleted %(count)d expired keys; live keys were kept.") % {"count": count},
            messages.SUCCESS,
        )


@admin.register(InboxEvent)
class InboxEventAdmin(_ReadOnlyAdmin):
    list_display = [
        "event_id",
        "source",
        "event_type",
        "status",
        "attempts",
        "received_at",
        "next_attempt_at",
        "processed_at",
    ]
    list_filter = ["status", "source", "event_type"]
    search_fields = ["event_id"]
    exact_search_field = "event_id"  # the (source, event id) index serves it
    rows_name = _("events")
    search_help_text = _("The exact event id the sender gave.")
    actions = ["reprocess", "retry_now", "mark_dead"]
    fieldsets = [
        (None, {"fields": ["source", "event_id", "event_type", "status", "payload_hash"]}),
        (_("Delivery"), {"fields": ["pretty_payload", "kept_headers"]}),
        (
            _("Processing"),
            {
                "fields": [
                    "attempts",
                    "received_at",
                    "next_attempt_at",
                    "processed_at",
                    "last_error",
                    "traceback",
                ]
            },
        ),
    ]

    # A deleted event would be processed again when its sender redelivers it: no deleting.

    @admin.display(description=_("last traceback"))
    def traceback(self, obj: InboxEvent) -> str:
        return format_html("<pre>{}</pre>", obj.last_traceback) if obj.last_traceback else "—"

    def has_process_permission(self, request: HttpRequest) -> bool:
        # The model's change permission: the pages stay read-only, the actions are allowed.
        return bool(request.user.has_perm("django_idempotency.change_inboxevent"))

    @admin.action(
        description=_("Reprocess the selected events from a clean slate"),
        permissions=["process"],
    )
    def reprocess(self, request: HttpRequest, queryset: QuerySet[InboxEvent]) -> None:
        # Events mid-attempt are left to finish.
        self._act(request, queryset, inbox.reprocess, _("Reprocessed"))

    @admin.action(description=_("Retry the selected failed events now"), permissions=["process"])
    def retry_now(self, request: HttpRequest, queryset: QuerySet[InboxEvent]) -> None:
        self._act(request, queryset, inbox.retry_now, _("Retried"))

    @admin.action(
        description=_("Mark the selected events dead: retry them no more"),
        permissions=["process"],
    )
    def mark_dead(self, request: HttpRequest, queryset: QuerySet[InboxEvent]) -> None:
        self._act(request, queryset, inbox.mark_dead, _("Marked dead"))


@admin.register(OutboxMessage)
class OutboxMessageAdmin(_ReadOnlyAdmin):
    list_display = [
        "message_id",
        "topic",
        "ordering_key",
        "status",
        "attempts",
        "created_at",
        "next_attempt_at",
        "dispatched_at",
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
                    "last_error",
                ]
            },
        ),
    ]

    def search_value(self, term: str) -> uuid.UUID | None:
        try:
            return uuid.UUID(term)
        except ValueError:
            return None  # a malformed id matches nothing

    # A message deleted before it was sent is lost; the purge deletes the dispatched ones, so
    # the page deletes nothing.

    def has_redeliver_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_idempotency.change_outboxmessage"))

    @admin.action(
        description=_("Redeliver the selected messages, with the same message ids"),
        permissions=["redeliver"],
    )
    def redeliver(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        self._act(request, queryset, redeliver, _("Redelivered"))
