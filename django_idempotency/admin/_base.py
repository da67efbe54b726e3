"""What the three admin pages share: a capped pager, read-only rows, exact search, logged
actions, and the cells they draw alike."""

from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.auth import get_permission_codename
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.core.validators import ProhibitNullCharactersValidator
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext_lazy as _

if TYPE_CHECKING:
    from collections.abc import Callable
    from datetime import datetime

    from django.contrib.admin.views.main import ChangeList
    from django.db.models import Model, QuerySet
    from django.http import HttpRequest, HttpResponse, QueryDict
    from django.utils.functional import _StrPromise

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
else:
    # Not subscriptable at run time.
    _ModelAdmin = admin.ModelAdmin

# Longer keys are cut to this many characters in the list; the full key is in the cell's title
# and on the key's page. A UUID keeps its first two groups (the demo prints its first eight).
KEY_SHOWN = 13


def _short_id(value: str, shown: int = KEY_SHOWN) -> str:
    """``value`` in a monospace cell, cut to ``shown`` characters; whole in its title."""
    short = value if len(value) <= shown + 3 else f"{value[:shown]}…"
    return format_html('<span class="idempotency-id" title="{}">{}</span>', value, short)


def _moment(moment: datetime) -> str:
    """A time in a list's narrow column, to the minute; its page shows it in full."""
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        moment.isoformat(),
        date_format(timezone.localtime(moment), "DATETIME_FORMAT"),
        # No year: keys live a day, and events and messages days.
        date_format(timezone.localtime(moment), "j M H:i"),
    )


def _moment_column(model: type[Model], name: str) -> Callable[[Any], str]:
    """A list column showing the time in ``name`` as :func:`_moment` does."""
    field = model._meta.get_field(name)

    @admin.display(description=field.verbose_name, ordering=name)  # type: ignore[union-attr] # a concrete field
    def column(obj: Any) -> str:
        moment = getattr(obj, name)
        return "—" if moment is None else _moment(moment)

    column.__name__ = name  # the cells' class: field-<name>
    return column


def _holds_nul(query: QueryDict) -> bool:
    """Whether a parameter's name or value in ``query`` holds a NUL character."""
    return any("\x00" in text for name, values in query.lists() for text in (name, *values))


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
    # Nor the filters' counts ("Show counts"): one count of the table per choice.
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    # One dash for every empty field: Django's own "-" beside our "—" read as two meanings.
    empty_value_display = "—"
    # The one field the search box matches exactly: only an exact match can use its index
    # (the default search would scan every row).
    exact_search_field = "id"
    # What the actions' messages call the rows: "Retried 1 of the 3 selected events."
    rows_name: str | _StrPromise = _("rows")

    def has_act_permission(self, request: HttpRequest) -> bool:
        """Whether the user may run the page's actions: the model's change permission, while the
        rows stay read-only."""
        codename = get_permission_codename("change", self.opts)
        return bool(request.user.has_perm(f"{self.opts.app_label}.{codename}"))

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

    def get_changelist_instance(self, request: HttpRequest) -> ChangeList:
        # PostgreSQL refuses NUL in text and would fail the page as it reads the rows; no row
        # holds one on any database. So a filter, lookup or search that holds one is refused as
        # the admin refuses any lookup it cannot make (the list again, at ?e=1), with the
        # message Django's search box gives for it.
        if _holds_nul(request.GET):
            self.message_user(request, ProhibitNullCharactersValidator.message, messages.ERROR)
            raise IncorrectLookupParameters
        return super().get_changelist_instance(request)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        # Rows are selected by primary key. A value that cannot be one (a form made by hand)
        # would fail the action as it reads the rows: it selects nothing, and the action is
        # refused as Django refuses an empty selection.
        pk = self.model._meta.pk
        try:
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                pk.clean(value, None)
        except ValidationError:
            self.message_user(
                request,
                _(
                    "Items must be selected in order to perform actions on them. No items have "
                    "been changed."
                ),
                messages.WARNING,
            )
            return None
        # Django 6.1 passes where the action was chosen (action_location); later ones may pass more.
        return super().response_action(request, queryset, *args, **kwargs)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # The lists need the width: at 1366 pixels, beside the site's navigation and the
        # filters, their last columns would scroll out of sight. The breadcrumbs lead back.
        extra_context = {"is_nav_sidebar_enabled": False, **(extra_context or {})}
        return super().changelist_view(request, extra_context)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # What a client was told, what arrived, what left: evidence, so nothing is editable.
        fieldsets = self.get_fieldsets(request, obj)
        return [str(field) for _name, options in fieldsets for field in options["fields"]]

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

    @admin.display(description=_("last error"))
    def error(self, obj: Any) -> str:
        # Shown as the traceback is when there is none, rather than as Django's "-".
        return str(obj.last_error) or "—"

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
