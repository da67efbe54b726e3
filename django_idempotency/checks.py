"""System checks for the ``IDEMPOTENCY`` setting and the database.

Ids are stable: never reuse one. Retired ids: none yet.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.checks import Error, Tags, register
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router

from django_idempotency.conf import DEFAULTS, UNSAFE_METHODS, resolve_callable
from django_idempotency.store import SUPPORTED_VENDORS

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from django.apps import AppConfig
    from django.core.checks import CheckMessage

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 field-name


def _strings(value: Any) -> bool:
    return (
        isinstance(value, Iterable)
        and not isinstance(value, str | bytes)
        and all(isinstance(item, str) for item in value)
    )


def _header(value: Any) -> str | None:
    if isinstance(value, str) and _TOKEN.fullmatch(value):
        return None
    return "must be an HTTP header name such as 'Idempotency-Key'"


def _key_required(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def _methods(value: Any) -> str | None:
    if _strings(value) and value and {method.upper() for method in value} <= UNSAFE_METHODS:
        return None
    return "must be a non-empty list drawn from POST, PUT, PATCH and DELETE"


def _ttl(value: Any) -> str | None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if (isinstance(value, timedelta) or number) and (
        value.total_seconds() if isinstance(value, timedelta) else value
    ) > 0:
        return None
    return "must be a positive timedelta or number of seconds"


def _wait_timeout(value: Any) -> str | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return None
    return "must be a number of seconds, zero or more"


def _scope_function(value: Any) -> str | None:
    try:
        resolve_callable(value, "SCOPE_FUNCTION")
    except ImproperlyConfigured as exc:
        return f"must be a callable or the dotted path of one ({exc})"
    return None


def _anonymous(value: Any) -> str | None:
    return None if value in ("shared", "reject") else "must be 'shared' or 'reject'"


def _fingerprint_headers(value: Any) -> str | None:
    if _strings(value) and all(_header(item) is None for item in value):
        return None
    return "must be a list of HTTP header names"


def _retryable_status_codes(value: Any) -> str | None:
    if isinstance(value, Iterable) and all(
        isinstance(code, int) and 100 <= code <= 599 for code in value
    ):
        return None
    return "must be a list of HTTP status codes"


def _mode(value: Any) -> str | None:
    return None if value in ("atomic", "lease") else "must be 'atomic' or 'lease'"


VALIDATORS: dict[str, tuple[str, Callable[[Any], str | None]]] = {
    "HEADER": ("django_idempotency.E003", _header),
    "KEY_REQUIRED": ("django_idempotency.E004", _key_required),
    "METHODS": ("django_idempotency.E005", _methods),
    "TTL": ("django_idempotency.E006", _ttl),
    "WAIT_TIMEOUT": ("django_idempotency.E007", _wait_timeout),
    "SCOPE_FUNCTION": ("django_idempotency.E008", _scope_function),
    "ANONYMOUS": ("django_idempotency.E009", _anonymous),
    "FINGERPRINT_HEADERS": ("django_idempotency.E010", _fingerprint_headers),
    "RETRYABLE_STATUS_CODES": ("django_idempotency.E011", _retryable_status_codes),
    "MODE": ("django_idempotency.E014", _mode),
    "LEASE_TIMEOUT": ("django_idempotency.E015", _ttl),
}


@register(Tags.compatibility)
def check_settings(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict):
        return [
            Error(
                "The IDEMPOTENCY setting must be a dict.",
                hint="Set IDEMPOTENCY = {...} with the keys listed in the settings reference.",
                id="django_idempotency.E001",
            )
        ]
    messages: list[CheckMessage] = [
        Error(
            f"Invalid IDEMPOTENCY setting: {name!r}.",
            hint=f"Valid keys are: {', '.join(sorted(DEFAULTS))}.",
            id="django_idempotency.E002",
        )
        for name in sorted(set(user) - set(DEFAULTS))
    ]
    for name, (check_id, validate) in VALIDATORS.items():
        if name in user and (problem := validate(user[name])) is not None:
            messages.append(
                Error(
                    f"IDEMPOTENCY['{name}'] {problem}; got {user[name]!r}.",
                    hint=f"Remove it to use the default, {DEFAULTS[name]!r}.",
                    id=check_id,
                )
            )
    return messages


@register(Tags.compatibility)
def check_database(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    from django_idempotency.models import IdempotencyKey  # noqa: PLC0415 - needs the app registry

    # The claim is one INSERT … ON CONFLICT … RETURNING: PostgreSQL, and SQLite from 3.35.
    connection: Any = connections[router.db_for_write(IdempotencyKey)]
    if connection.vendor not in SUPPORTED_VENDORS:
        return [
            Error(
                f"django_idempotency cannot store keys in a {connection.vendor} database.",
                hint="Route IdempotencyKey to a PostgreSQL database (or SQLite in development).",
                id="django_idempotency.E012",
            )
        ]
    if connection.vendor == "sqlite" and connection.Database.sqlite_version_info < (3, 35):
        return [
            Error(
                f"django_idempotency needs SQLite 3.35 or newer, not "
                f"{connection.Database.sqlite_version}.",
                hint="Use a Python built with a newer SQLite, or PostgreSQL.",
                id="django_idempotency.E013",
            )
        ]
    return []
