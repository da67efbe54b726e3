"""The idempotency keys' admin page: each key's principal named, filters and searches kept to
what the table's indexes serve, expired keys and stuck leases cleared."""

from __future__ import annotations

import json
from collections import defaultdict
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connections, router
from django.db.models import Q
from django.shortcuts import redirect
from django.urls import NoReverseMatch, path, reverse
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_POST

from django_idempotency.admin._base import _ModelAdmin, _moment, _ReadOnlyAdmin, _short_id
from django_idempotency.conf import TASK_METHOD, UNSAFE_METHODS
from django_idempotency.core.store import key_store
from django_idempotency.core.sweeper import NEEDS_ATTENTION
from django_idempotency.models import IdempotencyKey

if TYPE_CHECKING:
    from django.contrib.admin.views.main import ChangeList
    from django.db.models import Model, QuerySet
    from django.http import HttpRequest, HttpResponse
    from django.urls import URLPattern

# Larger stored bodies are summarised rather than shown.
SHOWN_BODY_BYTES = 64 * 1024
# How long the admin's "purge all expired keys" may run within its request.
PURGE_SECONDS = 10.0


class ExpiresFilter(admin.SimpleListFilter):
    """When keys expire: each choice is a range that the expiry index serves."""

    title = _("expires")
    parameter_name = "expires"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        # No "not expired": on a large table of live keys it would walk the expiry index end
        # to end.
        return [
            ("expired", _("Expired")),
            ("hour", _("Within an hour")),
            ("today", _("Today")),
            ("week", _("This week")),
        ]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> QuerySet[IdempotencyKey]:
        now = timezone.now()
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=now)
        midnight = timezone.localtime(now).replace(hour=0, minute=0, second=0, microsecond=0)
        until = {
            "hour": now + timedelta(hours=1),
            "today": midnight + timedelta(days=1),
            # Weeks start on Monday, as ISO 8601 has them.
            "week": midnight + timedelta(days=7 - midnight.weekday()),
        }.get(self.value() or "")
        if until is None:
            return queryset
        return queryset.filter(expires_at__gt=now, expires_at__lte=until)


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
        return [*methods, (TASK_METHOD, _("task"))]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> QuerySet[IdempotencyKey]:
        return queryset.filter(method=self.value()) if self.value() else queryset


def _principal(scope: str) -> str:
    """The principal part of a scope the default scope function built: ``auth.user:1``."""
    return scope.split(" ", 1)[0]


def _principal_target(principal: str) -> tuple[type[Model], Any] | None:
    """The model and primary key a principal such as ``auth.user:1`` names, if it names one."""
    label, _colon, pk = principal.rpartition(":")
    if "." not in label:
        return None
    try:
        model = apps.get_model(label)
        return model, model._meta.pk.to_python(pk)
    except (LookupError, ValueError, ValidationError):
        return None


def _prefix(field: str, prefix: str, vendor: str) -> Q:
    """Rows whose ``field`` starts with ``prefix``, case-sensitively, in a form an index serves.

    PostgreSQL: ``LIKE 'prefix%'``, which an index with a pattern operator class serves (see
    migration 0007). MariaDB (binary collation, migration 0005) and SQLite compare byte for
    byte, so a range on the field's plain index is the prefix; SQLite's LIKE would ignore case.
    """
    if vendor == "postgresql" or not prefix:
        return Q(**{f"{field}__startswith": prefix})
    after = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return Q(**{f"{field}__gte": prefix, f"{field}__lt": after})


@admin.register(IdempotencyKey)
class IdempotencyKeyAdmin(_ReadOnlyAdmin):
    # Who, and the operation: the scope names both, and one key may serve several.
    list_display = [
        "short_key",
        "who",
        "operation",
        "state",
        "status",
        "created",
        "expires",
        "replay_count",
    ]
    # Dates by expiry, as ranges the expiry index serves. Not date_hierarchy: it lists the
    # distinct days by reading every row (half a second at 1,000,000 keys). Not by creation:
    # that would need one more index, updated by every request.
    list_filter = ["state", ExpiresFilter, StuckLeaseFilter, NeedsAttentionFilter, MethodFilter]
    search_fields = ["key"]
    search_help_text = _(
        "A key or its first characters (case-sensitive); a username for that user's keys; "
        "route: and the start of a route pattern for its keys (route:payments/)."
    )
    actions = ["release_expired_leases", "delete_expired"]
    fieldsets = [
        (None, {"fields": ["key", "who", "scope", "method", "route", "state", "fingerprint"]}),
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

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        # Each form is one condition that an index serves, but the route's: an OR of them
        # would read the whole table.
        term = search_term.strip()
        if not term:
            return queryset, False
        vendor = connections[queryset.db].vendor
        if term.startswith("route:"):
            route = term.removeprefix("route:").strip().lstrip("/")
            return queryset.filter(_prefix("route", route, vendor)), False
        users = get_user_model()
        user = users._default_manager.filter(**{users.USERNAME_FIELD: term}).first()
        if user is not None:
            # What get_principal() puts before the method.
            principal = f"{user._meta.label_lower}:{user.pk} "
            return queryset.filter(_prefix("scope", principal, vendor)), False
        if not term.isascii() or not term.isprintable() or " " in term:
            return queryset.none(), False  # no key has such characters
        return queryset.filter(_prefix("key", term, vendor)), False

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        changelist = super().get_changelist_instance(request)
        self._name_principals(request, changelist.result_list)
        return changelist

    def _name_principals(self, request: HttpRequest, keys: Any) -> None:
        """Name each key's principal, with one query per kind of principal on the page."""
        wanted: dict[type[Model], dict[Any, list[IdempotencyKey]]] = defaultdict(dict)
        for key in keys:
            principal = _principal(key.scope)
            key._principal = (principal, None)
            if target := _principal_target(principal):
                model, pk = target
                wanted[model].setdefault(pk, []).append(key)
        for model, by_pk in wanted.items():
            url_name = f"admin:{model._meta.app_label}_{model._meta.model_name}_change"
            model_admin = self.admin_site._registry.get(model)
            linked = model_admin is not None and model_admin.has_view_or_change_permission(request)
            for obj in model._default_manager.filter(pk__in=by_pk):
                name = obj.get_username() if hasattr(obj, "get_username") else str(obj)
                url = None
                if linked:
                    try:
                        url = reverse(url_name, args=[obj.pk], current_app=self.admin_site.name)
                    except NoReverseMatch:
                        url = None
                for key in by_pk.get(obj.pk, []):
                    key._principal = (name, url)  # type: ignore[attr-defined]

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> IdempotencyKey | None:
        key = super().get_object(request, object_id, from_field)
        if key is not None:
            self._name_principals(request, [key])
        return key

    @admin.display(description=_("key"), ordering="key")
    def short_key(self, obj: IdempotencyKey) -> str:
        return _short_id(obj.key)

    @admin.display(description=_("who"))
    def who(self, obj: IdempotencyKey) -> str:
        """The principal as a person reads it: a username, linked to the user's page; a
        task's key says so (its name is the operation). Cut short, whole on hover."""
        principal = _principal(obj.scope)
        name, url = getattr(obj, "_principal", (principal, None))
        if obj.method == TASK_METHOD:
            tenant = obj.scope.partition("|tenant:")[2]
            name, url = (f"tenant {tenant}" if tenant else _("task")), None
        cut = format_html('<span class="idempotency-cut" title="{}">{}</span>', principal, name)
        if url:
            return format_html('<a href="{}">{}</a>', url, cut)
        return cut

    @admin.display(description=_("operation"), ordering="route")
    def operation(self, obj: IdempotencyKey) -> str:
        # A long route pattern is cut by the style sheet; the title holds it whole.
        operation = f"{obj.method} {obj.route}"
        return format_html(
            '<span class="idempotency-cut idempotency-route" title="{}">{}</span>',
            operation,
            operation,
        )

    @admin.display(description=_("status"), ordering="response_status")
    def status(self, obj: IdempotencyKey) -> int | None:
        return obj.response_status

    @admin.display(description=_("created at"), ordering="created_at")
    def created(self, obj: IdempotencyKey) -> str:
        return _moment(obj.created_at)

    @admin.display(description=_("expires at"), ordering="expires_at")
    def expires(self, obj: IdempotencyKey) -> str:
        return _moment(obj.expires_at)

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

    @admin.action(description=_("Release the selected expired leases"), permissions=["act"])
    def release_expired_leases(
        self, request: HttpRequest, queryset: QuerySet[IdempotencyKey]
    ) -> None:
        # What the sweeper does, to the selected keys only.
        now = timezone.now()
        stuck = list(queryset.filter(locked_until__lte=now))
        store = key_store(IdempotencyKey, router.db_for_write(IdempotencyKey))
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
