"""The ``IDEMPOTENCY`` settings dict, read through one typed object.

Each value is checked and converted once, then kept until ``setting_changed`` says the dict
changed (``override_settings`` sends it). Dotted paths are imported once and remembered.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from datetime import timedelta
from functools import cache
from typing import Any, Generic, Literal, NamedTuple, TypeVar, cast

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

T = TypeVar("T")

DEFAULTS: dict[str, Any] = {
    # Whether idempotent views handle keys at all; False makes them run as if undecorated.
    "ENABLED": True,
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
    # The deepest nesting of JSON arrays and objects read from a body ([] is 1 level, {"a": []}
    # 2); deeper JSON is refused with a 400. MariaDB's JSON columns refuse 32 levels, so 31 is
    # the most that every supported database stores.
    "MAX_JSON_DEPTH": 31,
    # Statuses that invite a retry: never stored, so that the retry executes again.
    "RETRYABLE_STATUS_CODES": (408, 409, 425, 429),
    # Statuses that reject the request as invalid: not stored either, so that the corrected
    # retry with the same key runs (a business 4xx such as 402, 403 or 404 is stored). 406, 413
    # and 415 are the framework's refusals of a request it could not read or answer.
    "INVALID_REQUEST_STATUS_CODES": (400, 406, 413, 415, 422),
    # "atomic": the key shares the view's transaction. "lease": the key is committed first and
    # held for LEASE_TIMEOUT, for views whose effect leaves the database.
    "MODE": "atomic",
    # Lease mode: how long a request owns its key before another may take it over.
    "LEASE_TIMEOUT": timedelta(seconds=60),
    # Lease mode: callable (or dotted path) ``(ExpiredKey) -> Reconciled | NothingHappened |
    # Unknown`` that the sweeper asks about a key whose lease ran out; None: release it.
    "RECONCILE": None,
    # How long the sweeper waits for the reconcile hook's answer about one key.
    "RECONCILE_TIMEOUT": timedelta(seconds=30),
    # A name of this project and environment that goes into every downstream key, so that two
    # that share a provider account never give it the same key. "": none, the keys of 1.0.
    "DOWNSTREAM_KEY_NAMESPACE": "",
    # Alias of a Django cache (Redis) that serves replays before the database; None: off.
    "CACHE": None,
    # Webhook inbox: "inline" processes an event in the request that recorded it, right after
    # the commit; "celery" hands it to a Celery worker; "database" only records it, for the
    # workers of `manage.py idempotency_inbox --forever` to take from the table.
    "INBOX_RUNNER": "inline",
    # Attempts at processing an event before it is dead and waits for a person.
    "INBOX_MAX_ATTEMPTS": 10,
    # Retry delay bound after the first failed attempt; it doubles with each attempt (full
    # jitter: the delay is drawn between zero and the bound) up to INBOX_RETRY_MAX_DELAY.
    "INBOX_RETRY_DELAY": timedelta(seconds=30),
    "INBOX_RETRY_MAX_DELAY": timedelta(hours=6),
    # How long processed events are kept before the purge deletes them.
    "INBOX_RETENTION": timedelta(days=30),
    # Transactional outbox: "inline" relays the messages a transaction published right after it
    # commits, in the same process; "celery" asks a Celery worker to.
    "OUTBOX_RUNNER": "inline",
    # Dispatch attempts before a message is dead and waits for a person.
    "OUTBOX_MAX_ATTEMPTS": 10,
    # Retry delay bound after the first failed dispatch, doubled each attempt (full jitter).
    "OUTBOX_RETRY_DELAY": timedelta(seconds=30),
    "OUTBOX_RETRY_MAX_DELAY": timedelta(hours=6),
    # How long dispatched messages are kept before the purge deletes them.
    "OUTBOX_RETENTION": timedelta(days=7),
}

UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# What the keys of idempotent Celery tasks hold in place of an HTTP method.
TASK_METHOD = "TASK"
AnonymousPolicy = Literal["shared", "reject"]
Mode = Literal["atomic", "lease"]
Runner = Literal["inline", "celery"]
InboxRunner = Literal["inline", "celery", "database"]


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


# What each key accepts: a message when the value is wrong, else None. The system checks,
# every read of a setting and every per-view option use these, through RULES below.
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


def _boolean(value: Any) -> str | None:
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


def _reconcile(value: Any) -> str | None:
    if value is None:
        return None
    try:
        resolve_callable(value, "RECONCILE")
    except ImproperlyConfigured as exc:
        return f"must be None, a callable or the dotted path of one ({exc})"
    return None


def _string(value: Any) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _anonymous(value: Any) -> str | None:
    return None if value in ("shared", "reject") else "must be 'shared' or 'reject'"


def _fingerprint_headers(value: Any) -> str | None:
    if _strings(value) and all(_header(item) is None for item in value):
        return None
    return "must be a list of HTTP header names"


def _status_codes(value: Any) -> str | None:
    if isinstance(value, Iterable) and all(
        isinstance(code, int) and 100 <= code <= 599 for code in value
    ):
        return None
    return "must be a list of HTTP status codes"


def _cache(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value in settings.CACHES):
        return None
    return "must be None or the alias of a cache in CACHES"


def _mode(value: Any) -> str | None:
    return None if value in ("atomic", "lease") else "must be 'atomic' or 'lease'"


def _runner(value: Any) -> str | None:
    return None if value in ("inline", "celery") else "must be 'inline' or 'celery'"


def _inbox_runner(value: Any) -> str | None:
    if value in ("inline", "celery", "database"):
        return None
    return "must be 'inline', 'celery' or 'database'"


def _positive_int(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return None
    return "must be a positive whole number"


# Parsing and canonicalizing JSON recurse once per level or more, on top of the request's own
# frames: a limit this low keeps the deepest body allowed well inside Python's recursion limit
# (1,000), where a few thousand levels would exhaust it mid-request.
DEEPEST_JSON = 200


def _json_depth(value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= DEEPEST_JSON:
        return None
    return f"must be a whole number from 1 to {DEEPEST_JSON}"


def _seconds(value: timedelta | float) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


def _upper(methods: Iterable[str]) -> frozenset[str]:
    return frozenset(method.upper() for method in methods)


def _callable(value: Any) -> Callable[..., Any]:
    return resolve_callable(value, "SCOPE_FUNCTION")  # already validated


def _hook(value: Any) -> Callable[..., Any] | None:
    return None if value is None else resolve_callable(value, "RECONCILE")


class Rule(NamedTuple):
    """How one setting is checked, and turned into the value the code uses once it passes."""

    check_id: str
    problem: Callable[[Any], str | None]  # a message when the value is wrong, else None
    coerce: Callable[[Any], Any] = lambda value: value


RULES: dict[str, Rule] = {
    "HEADER": Rule("django_idempotency.E003", _header, str),
    "KEY_REQUIRED": Rule("django_idempotency.E004", _boolean, bool),
    "METHODS": Rule("django_idempotency.E005", _methods, _upper),
    "TTL": Rule("django_idempotency.E006", _ttl, _seconds),
    "WAIT_TIMEOUT": Rule("django_idempotency.E007", _wait_timeout, float),
    "SCOPE_FUNCTION": Rule("django_idempotency.E008", _scope_function, _callable),
    "ANONYMOUS": Rule("django_idempotency.E009", _anonymous),
    "FINGERPRINT_HEADERS": Rule("django_idempotency.E010", _fingerprint_headers, tuple),
    "RETRYABLE_STATUS_CODES": Rule("django_idempotency.E011", _status_codes, frozenset),
    "INVALID_REQUEST_STATUS_CODES": Rule("django_idempotency.E029", _status_codes, frozenset),
    "MODE": Rule("django_idempotency.E014", _mode),
    "LEASE_TIMEOUT": Rule("django_idempotency.E015", _ttl, _seconds),
    "CACHE": Rule("django_idempotency.E016", _cache),
    "INBOX_RUNNER": Rule("django_idempotency.E017", _inbox_runner),
    "INBOX_MAX_ATTEMPTS": Rule("django_idempotency.E018", _positive_int, int),
    "INBOX_RETRY_DELAY": Rule("django_idempotency.E019", _ttl, _seconds),
    "INBOX_RETRY_MAX_DELAY": Rule("django_idempotency.E020", _ttl, _seconds),
    "INBOX_RETENTION": Rule("django_idempotency.E021", _ttl, _seconds),
    "OUTBOX_RUNNER": Rule("django_idempotency.E022", _runner),
    "OUTBOX_MAX_ATTEMPTS": Rule("django_idempotency.E023", _positive_int, int),
    "OUTBOX_RETRY_DELAY": Rule("django_idempotency.E024", _ttl, _seconds),
    "OUTBOX_RETRY_MAX_DELAY": Rule("django_idempotency.E025", _ttl, _seconds),
    "OUTBOX_RETENTION": Rule("django_idempotency.E026", _ttl, _seconds),
    "ENABLED": Rule("django_idempotency.E027", _boolean, bool),
    "RECONCILE": Rule("django_idempotency.E030", _reconcile, _hook),
    "RECONCILE_TIMEOUT": Rule("django_idempotency.E031", _ttl, _seconds),
    "MAX_JSON_DEPTH": Rule("django_idempotency.E034", _json_depth, int),
    "DOWNSTREAM_KEY_NAMESPACE": Rule("django_idempotency.E035", _string, str),
}


def checked(name: str, value: Any, label: str) -> Any:
    """``value`` for setting ``name`` as the code uses it; a wrong one raises, naming ``label``."""
    rule = RULES[name]
    if (problem := rule.problem(value)) is not None:
        msg = f"{label} {problem}; got {value!r}."
        raise ImproperlyConfigured(msg)
    return rule.coerce(value)


class _Setting(Generic[T]):
    """One key of ``IDEMPOTENCY``, as the code uses it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type) -> T:
        return cast("T", instance.get(self.name))


class IdempotencySettings:
    """Typed, read-only view of ``settings.IDEMPOTENCY`` with defaults.

    Each value is checked and converted once, then kept until the setting changes
    (``override_settings`` and the test client's ``settings`` say so with ``setting_changed``).
    """

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    @property
    def user_settings(self) -> dict[str, Any]:
        value = getattr(settings, "IDEMPOTENCY", {})
        return value if isinstance(value, dict) else {}

    def get(self, name: str) -> Any:
        """The value of setting ``name``; a wrong one raises, naming the setting."""
        try:
            return self._values[name]
        except KeyError:
            pass
        user = self.user_settings
        value = user.get(name, DEFAULTS[name])
        label = f"IDEMPOTENCY['{name}'] ({RULES[name].check_id})"
        value = checked(name, value, label) if name in user else RULES[name].coerce(value)
        self._values[name] = value
        return value

    def reload(self) -> None:
        """Forget the values read so far: ``settings.IDEMPOTENCY`` has changed."""
        self._values.clear()

    ENABLED = _Setting[bool]()
    HEADER = _Setting[str]()
    KEY_REQUIRED = _Setting[bool]()
    METHODS = _Setting[frozenset[str]]()
    TTL = _Setting[timedelta]()
    WAIT_TIMEOUT = _Setting[float]()
    SCOPE_FUNCTION = _Setting[Callable[..., str]]()
    ANONYMOUS = _Setting[AnonymousPolicy]()
    FINGERPRINT_HEADERS = _Setting[tuple[str, ...]]()
    MAX_JSON_DEPTH = _Setting[int]()
    RETRYABLE_STATUS_CODES = _Setting[frozenset[int]]()
    INVALID_REQUEST_STATUS_CODES = _Setting[frozenset[int]]()
    MODE = _Setting[Mode]()
    CACHE = _Setting[str | None]()
    RECONCILE = _Setting[Callable[..., Any] | None]()
    RECONCILE_TIMEOUT = _Setting[timedelta]()
    DOWNSTREAM_KEY_NAMESPACE = _Setting[str]()
    LEASE_TIMEOUT = _Setting[timedelta]()
    INBOX_RUNNER = _Setting[InboxRunner]()
    INBOX_MAX_ATTEMPTS = _Setting[int]()
    INBOX_RETRY_DELAY = _Setting[timedelta]()
    INBOX_RETRY_MAX_DELAY = _Setting[timedelta]()
    INBOX_RETENTION = _Setting[timedelta]()
    OUTBOX_RUNNER = _Setting[Runner]()
    OUTBOX_MAX_ATTEMPTS = _Setting[int]()
    OUTBOX_RETRY_DELAY = _Setting[timedelta]()
    OUTBOX_RETRY_MAX_DELAY = _Setting[timedelta]()
    OUTBOX_RETENTION = _Setting[timedelta]()


idempotency_settings = IdempotencySettings()


@receiver(setting_changed)
def _reload_settings(*, setting: str, **kwargs: Any) -> None:
    if setting == "IDEMPOTENCY":
        idempotency_settings.reload()
