"""System checks for the ``IDEMPOTENCY`` setting and the database.

Ids are stable: never reuse one. Retired: W001 (became E012 before any release).
"""

from __future__ import annotations

import difflib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import DEFAULT_DB_ALIAS, connections, router

from django_idempotency.conf import DEFAULTS, RULES
from django_idempotency.core import task_runs
from django_idempotency.core.databases import SUPPORTED_VENDORS, behind_pooler
from django_idempotency.operations.urlconf import (
    VIEW_ATTRIBUTES,
    idempotent_views,
    lease_mode_views,
    project_patterns,
)
from django_idempotency.policy import SETTING_OF

if TYPE_CHECKING:
    from collections.abc import Sequence

    from django.apps import AppConfig
    from django.core.checks import CheckMessage

logger = logging.getLogger("django_idempotency")


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
    for name, rule in RULES.items():
        if name in user and (problem := rule.problem(user[name])) is not None:
            messages.append(
                Error(
                    f"IDEMPOTENCY['{name}'] {problem}; got {user[name]!r}.",
                    hint=f"Remove it to use the default, {DEFAULTS[name]!r}.",
                    id=rule.check_id,
                )
            )
    return messages


@register(Tags.database)
def check_mariadb(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """What only the server can tell: MariaDB, not MySQL, 10.6 or newer; the isolation level.

    A database check, so it runs where Django connects anyway (migrate, check --database).
    """
    from django_idempotency.models import IdempotencyKey  # noqa: PLC0415 - needs the app registry

    alias = router.db_for_write(IdempotencyKey)
    connection: Any = connections[alias]
    if alias not in (databases or ()) or connection.vendor != "mysql":
        return []
    if not connection.mysql_is_mariadb or connection.mysql_version < (10, 6):
        server = "MariaDB" if connection.mysql_is_mariadb else "MySQL"
        version = ".".join(map(str, connection.mysql_version))
        return [
            Error(
                f"django_idempotency needs MariaDB 10.6 or newer, not {server} {version}.",
                hint="Claims on MySQL are not supported yet; route IdempotencyKey to MariaDB "
                "10.6+ or PostgreSQL.",
                id="django_idempotency.E028",
            )
        ]
    # Every decision on a key is made on a locked row, under any level; but above READ
    # COMMITTED, InnoDB's gap locks make concurrent relays and inbox runs deadlock. (Sweeps
    # and purges set their own transactions to READ COMMITTED.)
    if connection.isolation_level != "read committed":
        return [
            Warning(
                f"The {alias!r} database runs at {connection.isolation_level!r}: concurrent "
                "outbox relays and inbox runs can deadlock there.",
                hint="Remove OPTIONS['isolation_level'] to use Django's 'read committed'.",
                id="django_idempotency.W006",
            )
        ]
    return []


@register(Tags.database)
def check_pooler(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """What fails through a pooler in transaction mode (PgBouncer), on each PostgreSQL database
    reached through one. A database check: it connects."""
    messages: list[CheckMessage] = []
    for alias in databases or ():
        connection = connections[alias]
        if connection.vendor != "postgresql" or not behind_pooler(connection):
            continue
        config = connection.settings_dict
        if not config.get("DISABLE_SERVER_SIDE_CURSORS"):
            messages.append(
                Warning(
                    f"The {alias!r} database is reached through a connection pooler, and "
                    "DISABLE_SERVER_SIDE_CURSORS is not set: in transaction pooling mode, "
                    "QuerySet.iterator() fails there.",
                    hint=f"Set DATABASES[{alias!r}]['DISABLE_SERVER_SIDE_CURSORS'] = True; in "
                    "session pooling mode, silence this warning.",
                    id="django_idempotency.W008",
                )
            )
        options = config.get("OPTIONS", {})
        if options.get("server_side_binding") and options.get("prepare_threshold", 5) is not None:
            messages.append(
                Warning(
                    f"The {alias!r} database is reached through a connection pooler, with "
                    "server-side binding: psycopg prepares statements, which a pooler in "
                    "transaction mode hands to other connections.",
                    hint=f"Remove OPTIONS['server_side_binding'] from DATABASES[{alias!r}], or "
                    "set OPTIONS['prepare_threshold'] = None there.",
                    id="django_idempotency.W009",
                )
            )
    return messages


@register(Tags.compatibility)
def check_database(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    # A model: imported here, so that importing this module does not need the app registry.
    from django_idempotency.models import IdempotencyKey  # noqa: PLC0415

    # The claim is one INSERT … ON CONFLICT … RETURNING: PostgreSQL, and SQLite from 3.35;
    # on MariaDB an INSERT … ON DUPLICATE KEY UPDATE, whose server check_mariadb() reads.
    alias = router.db_for_write(IdempotencyKey)
    connection: Any = connections[alias]
    if connection.vendor not in SUPPORTED_VENDORS:
        return [
            Error(
                f"django_idempotency cannot store keys in a {connection.vendor} database.",
                hint="Route IdempotencyKey to a PostgreSQL or MariaDB database (or SQLite in "
                "development).",
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
    if alias != DEFAULT_DB_ALIAS:
        return [
            Warning(
                f"Idempotency keys are stored in the {alias!r} database: in atomic mode only a "
                f"view's writes to {alias!r} share the key's transaction.",
                hint="Route IdempotencyKey to the database your idempotent views write to, or "
                "give views that write elsewhere idempotency_mode = 'lease'.",
                id="django_idempotency.W002",
            )
        ]
    return []


@register(Tags.caches)
def check_cache(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    alias = user.get("CACHE") if isinstance(user, dict) else None
    if not isinstance(alias, str) or alias not in settings.CACHES:
        return []
    config = settings.CACHES[alias]
    messages: list[CheckMessage] = []
    # django-redis can return "no entry" on every error: the replay cache stays correct (the
    # database answers), but an outage never reaches the logs.
    if _ignores_exceptions(config):
        messages.append(
            Warning(
                f"The replay cache {alias!r} ignores its errors: an outage would go unnoticed.",
                hint="Drop IGNORE_EXCEPTIONS for this cache; django_idempotency already falls "
                "back to the database and logs each cache error.",
                id="django_idempotency.W003",
            )
        )
    if missing := _missing_redis_timeouts(config):
        messages.append(
            Warning(
                f"The replay cache {alias!r} has no {' and no '.join(missing)}: a Redis that "
                "stops answering would hold each request until the client gives up.",
                hint="Set the socket and connect timeouts in the cache's OPTIONS, for example "
                "0.5 seconds each (see the CACHE setting in the settings reference).",
                id="django_idempotency.W004",
            )
        )
    return messages


def _ignores_exceptions(config: dict[str, Any]) -> bool:
    """Whether a cache swallows its errors, as django-redis's IGNORE_EXCEPTIONS makes it do."""
    options = config.get("OPTIONS", {})
    if "IGNORE_EXCEPTIONS" in options:
        # The cache's own option wins over the project-wide one, even when it is False.
        return bool(options["IGNORE_EXCEPTIONS"])
    # Only django-redis reads the project-wide setting.
    return str(config.get("BACKEND", "")).startswith("django_redis.") and bool(
        getattr(settings, "DJANGO_REDIS_IGNORE_EXCEPTIONS", False)
    )


def _missing_redis_timeouts(config: dict[str, Any]) -> list[str]:
    """Which of a Redis cache's socket and connect timeouts are not set; [] for other caches."""
    kwargs = _redis_connection_kwargs(config)
    if kwargs is None:
        return []
    socket = kwargs.get("socket_timeout") is not None
    # redis-py connects with the socket timeout when it is given no connect timeout.
    connect = socket or kwargs.get("socket_connect_timeout") is not None
    return [
        label
        for label, present in (("socket timeout", socket), ("connect timeout", connect))
        if not present
    ]


def _redis_connection_kwargs(config: dict[str, Any]) -> dict[str, Any] | None:
    """What a Redis cache backend passes to redis-py's connections; None for other caches."""
    options = config.get("OPTIONS", {})
    if config.get("BACKEND") == "django.core.cache.backends.redis.RedisCache":
        kwargs = dict(options)
    elif config.get("BACKEND") == "django_redis.cache.RedisCache":
        # django-redis has names of its own (and drops a timeout of 0: no timeout), then passes
        # CONNECTION_POOL_KWARGS on as they are, over its own.
        kwargs = {
            "socket_timeout": options.get("SOCKET_TIMEOUT") or None,
            "socket_connect_timeout": options.get("SOCKET_CONNECT_TIMEOUT") or None,
            **options.get("CONNECTION_POOL_KWARGS", {}),
        }
    else:
        return None
    locations = config.get("LOCATION", "")
    if isinstance(locations, str):
        locations = locations.split(",")
    queries = [parse_qs(urlsplit(location).query) for location in locations if location]
    for name in ("socket_timeout", "socket_connect_timeout"):
        # redis-py also reads it from the query string of a redis:// URL.
        if kwargs.get(name) is None and queries and all(name in query for query in queries):
            kwargs[name] = queries[0][name][0]
    return kwargs


@register(Tags.compatibility)
def check_asgi_connections(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    """Persistent connections in a project served over ASGI, as its ASGI_APPLICATION says.

    ASGI servers do not run system checks: the first request an ASGI handler serves logs the
    same warnings (``warn_of_asgi_connections``).
    """
    if not getattr(settings, "ASGI_APPLICATION", None):
        return []
    return persistent_connections_under_asgi()


def persistent_connections_under_asgi() -> list[CheckMessage]:
    """A warning for each database that keeps its connections open and has no pool.

    Under ASGI, each request's synchronous code runs in a thread of its own, and each thread
    opens its own connection: with CONN_MAX_AGE they outlive the request, until the server
    refuses more clients.
    """
    return [
        Warning(
            f"DATABASES[{alias!r}] keeps connections open "
            f"(CONN_MAX_AGE = {config['CONN_MAX_AGE']}) in a project served over ASGI: each "
            "request's thread opens a connection of its own, and they pile up until the "
            "database refuses more clients.",
            hint="Set CONN_MAX_AGE = 0 for it, or on PostgreSQL use Django's connection pool "
            "(OPTIONS['pool'] = True, with psycopg's pool installed).",
            id="django_idempotency.W010",
        )
        for alias, config in settings.DATABASES.items()
        if config.get("CONN_MAX_AGE", 0) != 0 and not _pooled(config)
    ]


def _pooled(config: dict[str, Any]) -> bool:
    options: dict[str, Any] = config.get("OPTIONS", {})
    return bool(options.get("pool"))


def warn_of_asgi_connections(sender: type, **kwargs: Any) -> None:
    """``request_started`` receiver: the first ASGI request logs W010; any request disconnects
    it, so it costs one call per process."""
    from django.core.handlers.asgi import ASGIHandler  # noqa: PLC0415
    from django.core.signals import request_started  # noqa: PLC0415

    request_started.disconnect(warn_of_asgi_connections)
    if isinstance(sender, type) and issubclass(sender, ASGIHandler):
        for message in persistent_connections_under_asgi():
            logger.warning("%s (%s) %s", message.msg, message.id, message.hint)


# The deepest JSON that MariaDB's JSON columns take, counted as MAX_JSON_DEPTH counts ([] is one
# level): Django checks a JSONField there with JSON_VALID(), which refuses 32 levels (its
# JSON_DEPTH_LIMIT), and the insert fails with an IntegrityError. MySQL's JSON type takes 100
# levels, but MySQL is not supported (E028), and telling the two apart needs a connection.
# PostgreSQL's jsonb takes thousands of levels and SQLite's JSON functions 1,000 or more: more
# than MAX_JSON_DEPTH may be.
MARIADB_JSON_DEPTH = 31


@register(Tags.compatibility)
def check_json_depth(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    depth = user.get("MAX_JSON_DEPTH") if isinstance(user, dict) else None
    if depth is None or RULES["MAX_JSON_DEPTH"].problem(depth) is not None:
        return []  # the default, or an invalid value that E034 reports
    if depth <= MARIADB_JSON_DEPTH:
        return []
    # Any database may be where a view writes the body, not only the one that holds the keys.
    return [
        Warning(
            f"IDEMPOTENCY['MAX_JSON_DEPTH'] is {depth}, but the {alias!r} database refuses JSON "
            f"nested deeper than {MARIADB_JSON_DEPTH} levels: a body between the two that a "
            "view stores there fails with a 500 instead of a 400.",
            hint=f"Use {MARIADB_JSON_DEPTH} or less, or remove it to use the default, "
            f"{DEFAULTS['MAX_JSON_DEPTH']}.",
            id="django_idempotency.W007",
        )
        for alias in connections
        if connections[alias].vendor == "mysql"
    ]


# A lease is renewed every third of its length: under this, one slow renewal round trip (a
# database failover, a long pause of the process) hands a live request's key to its retry.
MIN_LEASE_SECONDS = 3.0


@register(Tags.compatibility)
def check_lease(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[CheckMessage]:
    user = getattr(settings, "IDEMPOTENCY", {})
    lease = user.get("LEASE_TIMEOUT") if isinstance(user, dict) else None
    if lease is None or RULES["LEASE_TIMEOUT"].problem(lease) is not None:
        return []  # the default, or an invalid value that E015 reports
    seconds = lease.total_seconds() if isinstance(lease, timedelta) else float(lease)
    if seconds >= MIN_LEASE_SECONDS:
        return []
    return [
        Warning(
            f"IDEMPOTENCY['LEASE_TIMEOUT'] is {seconds:g} s: a live request renews its lease "
            "every third of that, so a short pause of the database or of the process lets a "
            "retry take its key over.",
            hint=f"Use at least {MIN_LEASE_SECONDS:g} seconds; the lease only decides how soon "
            "a dead request's key is taken over.",
            id="django_idempotency.W005",
        )
    ]


@register(Tags.urls)
def check_views(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """The options of each idempotent view in the URLconf, checked as its first request would.

    A misspelt ``idempotency_*`` attribute on a DRF view would otherwise be ignored, and a
    wrong value found only by the view's first request.
    """
    messages: list[CheckMessage] = []
    known = sorted(VIEW_ATTRIBUTES)
    for view, label, options, unknown in idempotent_views(project_patterns()):
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=1)
            messages.append(
                Error(
                    f"{label}.{name} is not an idempotency option: it would be ignored.",
                    hint=f"Did you mean {close[0]}?"
                    if close
                    else f"The options: {', '.join(known)}.",
                    obj=view,
                    id="django_idempotency.E032",
                )
            )
        for name, value in options.items():
            rule = RULES[SETTING_OF[name]]
            if value is not None and (problem := rule.problem(value)) is not None:
                messages.append(
                    Error(
                        f"{label}'s {name} option {problem}; got {value!r}.",
                        hint=f"Leave it unset (None) to follow IDEMPOTENCY['{SETTING_OF[name]}'].",
                        obj=view,
                        id="django_idempotency.E033",
                    )
                )
    return messages


@register(Tags.urls)
def check_downstream_namespace(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Downstream keys without a namespace of the project, where they are handed to a provider.

    What hands them out, as far as can be seen before a request: a view or Ninja operation in
    lease mode (its option, else ``MODE``), and an idempotent task in lease mode or whose body
    takes its key, among the tasks declared by then. ``key_of(request).downstream_key`` in an
    atomic view, or a mode chosen per request, cannot be seen.
    """
    user = getattr(settings, "IDEMPOTENCY", {})
    if not isinstance(user, dict) or user.get("DOWNSTREAM_KEY_NAMESPACE"):
        return []  # E001 reports a setting that is not a dict, E035 a namespace of a wrong type
    found = _givers_of_downstream_keys(user.get("MODE") or DEFAULTS["MODE"])
    if not found:
        return []
    (what, obj), more = found[0], len(found) - 1
    return [
        Warning(
            f"{what}{f' (and {more} more)' if more else ''} gives a provider downstream keys, "
            "and IDEMPOTENCY['DOWNSTREAM_KEY_NAMESPACE'] is not set: another service or "
            "environment on the same provider account, with equal user ids, routes and keys, "
            "would give it the same keys, and the provider would replay one's effects to the "
            "other.",
            hint="Set it to a name of this project and environment, such as "
            "'payments-production', once: it changes every downstream key, so set it before "
            "going live or while no lease is in flight, and never change it. If no other "
            "project uses the provider account, silence django_idempotency.W011.",
            obj=obj,
            id="django_idempotency.W011",
        )
    ]


def _givers_of_downstream_keys(mode: str) -> list[tuple[str, Any]]:
    """What hands a provider downstream keys: a description of each, and the object."""
    found = lease_mode_views(mode)
    # The idempotent tasks declared with either adapter (Celery's, Django's Tasks framework's).
    for name, (task_mode, takes_key) in task_runs.DECLARED_TASKS.items():
        if task_mode == "lease":
            found.append((f"The lease-mode task {name}", None))
        elif takes_key:
            found.append((f"The task {name}, whose body takes its key,", None))
    return found
