"""The idempotent views of the project's URLconf and their options, as the system checks read
them before any request: DRF views with the mixin, views under ``@idempotent``, and Django Ninja
operations under its ``@idempotent``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from django.urls import URLResolver, get_resolver

from django_idempotency.policy import SETTING_OF

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

# The DRF mixin's attributes: one per option, and the engine.
VIEW_ATTRIBUTES = frozenset(f"idempotency_{name}" for name in (*SETTING_OF, "engine"))


def project_patterns() -> list[Any]:
    """The URL patterns of the project's URLconf; none if it fails, as Django's checks say."""
    try:
        return list(get_resolver().url_patterns)
    except Exception:  # Django's own URL checks report a URLconf that fails
        return []


def lease_mode_views(mode: str) -> list[tuple[str, Any]]:
    """The project's views and Ninja operations in lease mode, by their option or else by
    ``mode`` (the ``MODE`` setting's): a description of each, and the view."""
    patterns = project_patterns()
    return [
        (f"The lease-mode {kind} {label}", view)
        for kind, views in (
            ("view", idempotent_views(patterns)),
            ("operation", idempotent_operations(patterns)),
        )
        for view, label, options, *_ in views
        if (options.get("mode") or mode) == "lease"
    ]


def callbacks(patterns: Iterable[Any]) -> Iterator[Any]:
    """The view of each URL pattern, included URLconfs' too."""
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from callbacks(pattern.url_patterns)
        else:
            yield pattern.callback


def idempotent_views(
    patterns: Iterable[Any],
) -> Iterator[tuple[Any, str, dict[str, Any], list[str]]]:
    """Each idempotent view once: itself, its name, its options and its unknown attributes."""
    seen: set[int] = set()
    for callback in callbacks(patterns):
        if (found := _options_of(callback)) is not None and id(found[0]) not in seen:
            seen.add(id(found[0]))
            yield found


def idempotent_operations(patterns: Iterable[Any]) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """Each Django Ninja operation under ``@idempotent``: its function, name and options."""
    # The adapter's module is imported by the project's operations if any uses it; Ninja is
    # optional.
    ninja = sys.modules.get("django_idempotency.ninja")
    if ninja is None:
        return
    for callback in callbacks(patterns):
        for operation in ninja.ninja_operations(callback):
            function = operation.view_func
            options = getattr(function, "idempotency_options", None)
            if options is not None:
                yield function, function.__qualname__, options


def _options_of(callback: Any) -> tuple[Any, str, dict[str, Any], list[str]] | None:
    # The mixin's module is imported by the project's views if any uses it; DRF is optional.
    drf = sys.modules.get("django_idempotency.drf")
    view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
    if (
        drf is not None
        and isinstance(view_class, type)
        and issubclass(view_class, drf.IdempotentMixin)
    ):
        unknown = [
            name
            for name in dir(view_class)
            if name.startswith("idempotency_") and name not in VIEW_ATTRIBUTES
        ]
        options = {name: getattr(view_class, f"idempotency_{name}") for name in SETTING_OF}
        # A property is read per request, from the view: nothing to check here.
        options = {
            name: value for name, value in options.items() if not isinstance(value, property)
        }
        return view_class, view_class.__qualname__, options, unknown
    decorated = getattr(callback, "idempotency_options", None)  # @idempotent's
    return None if decorated is None else (callback, callback.__qualname__, decorated, [])
