"""The ``IDEMPOTENCY`` settings dict, read through one typed object.

Settings are read live on every access, so ``override_settings`` needs no cache to reset. Dotted
paths are imported once and remembered.
"""

from __future__ import annotations

from datetime import timedelta
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from collections.abc import Callable

DEFAULTS: dict[str, Any] = {
    # Header that carries the key (IETF draft-ietf-httpapi-idempotency-key-header).
    "HEADER": "Idempotency-Key",
    # Whether a request to an idempotent view must carry a key.
    "KEY_REQUIRED": True,
    # Methods made idempotent; PUT is idempotent by definition and therefore opt-in.
    "METHODS": ("POST", "PATCH", "DELETE"),
    # How long a stored response can be replayed.
    "TTL": timedelta(hours=24),
    # How long, in seconds, a duplicate waits for the first request before answering 409.
    "WAIT_TIMEOUT": 3.0,
    # Callable (or dotted path) ``(request, route) -> str`` that scopes keys.
    "SCOPE_FUNCTION": "django_idempotency.scope.default_scope",
    # What anonymous requests get: "shared" (one anonymous principal) or "reject" (403).
    "ANONYMOUS": "shared",
    # Request headers that are part of the fingerprint, for example a tenant header.
    "FINGERPRINT_HEADERS": (),
    # Statuses that invite a retry: never stored, so that the retry executes again.
    "RETRYABLE_STATUS_CODES": (408, 409, 425, 429),
    # "atomic": the key shares the view's transaction. "lease": the key is committed first and
    # held for LEASE_TIMEOUT, for views whose effect leaves the database.
    "MODE": "atomic",
    # Lease mode: how long a request owns its key before another may take it over.
    "LEASE_TIMEOUT": timedelta(seconds=60),
}

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
AnonymousPolicy = Literal["shared", "reject"]
Mode = Literal["atomic", "lease"]


@cache
def _import(path: str) -> Any:
    return import_string(path)


def resolve_callable(value: Any, setting: str) -> Callable[..., Any]:
    """Return ``value`` itself if callable, else import it as a dotted path."""
    if isinstance(value, str):
        try:
            value = _import(value)
        except ImportError as exc:
            msg = f"{setting}: cannot import {value!r} ({exc})."
            raise ImproperlyConfigured(msg) from exc
    if not callable(value):
        msg = f"{setting}: {value!r} is not callable."
        raise ImproperlyConfigured(msg)
    return value  # type: ignore[no-any-return]


def as_timedelta(value: Any, setting: str) -> timedelta:
    """Accept a ``timedelta`` or a number of seconds."""
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = timedelta(seconds=value)
    else:
        msg = f"{setting} must be a timedelta or a number of seconds, not {value!r}."
        raise ImproperlyConfigured(msg)
    if result <= timedelta(0):
        msg = f"{setting} must be positive, not {value!r}."
        raise ImproperlyConfigured(msg)
    return result


class IdempotencySettings:
    """Typed, read-only view of ``settings.IDEMPOTENCY`` with defaults."""

    @property
    def user_settings(self) -> dict[str, Any]:
        value = getattr(settings, "IDEMPOTENCY", {})
        return value if isinstance(value, dict) else {}

    def get(self, name: str) -> Any:
        return self.user_settings.get(name, DEFAULTS[name])

    @property
    def HEADER(self) -> str:
        return str(self.get("HEADER"))

    @property
    def KEY_REQUIRED(self) -> bool:
        return bool(self.get("KEY_REQUIRED"))

    @property
    def METHODS(self) -> frozenset[str]:
        return frozenset(method.upper() for method in self.get("METHODS"))

    @property
    def TTL(self) -> timedelta:
        return as_timedelta(self.get("TTL"), "IDEMPOTENCY['TTL']")

    @property
    def WAIT_TIMEOUT(self) -> float:
        return float(self.get("WAIT_TIMEOUT"))

    @property
    def SCOPE_FUNCTION(self) -> Callable[..., str]:
        return resolve_callable(self.get("SCOPE_FUNCTION"), "IDEMPOTENCY['SCOPE_FUNCTION']")

    @property
    def ANONYMOUS(self) -> AnonymousPolicy:
        value = self.get("ANONYMOUS")
        if value not in ("shared", "reject"):
            msg = f"IDEMPOTENCY['ANONYMOUS'] must be 'shared' or 'reject', not {value!r}."
            raise ImproperlyConfigured(msg)
        return value  # type: ignore[no-any-return]

    @property
    def FINGERPRINT_HEADERS(self) -> tuple[str, ...]:
        return tuple(self.get("FINGERPRINT_HEADERS"))

    @property
    def RETRYABLE_STATUS_CODES(self) -> frozenset[int]:
        return frozenset(self.get("RETRYABLE_STATUS_CODES"))

    @property
    def MODE(self) -> Mode:
        value = self.get("MODE")
        if value not in ("atomic", "lease"):
            msg = f"IDEMPOTENCY['MODE'] must be 'atomic' or 'lease', not {value!r}."
            raise ImproperlyConfigured(msg)
        return value  # type: ignore[no-any-return]

    @property
    def LEASE_TIMEOUT(self) -> timedelta:
        return as_timedelta(self.get("LEASE_TIMEOUT"), "IDEMPOTENCY['LEASE_TIMEOUT']")


idempotency_settings = IdempotencySettings()
