from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.cache import caches as django_caches
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.core.management import call_command
from django.core.signals import request_started
from django.db import connection
from django.http import HttpResponse
from django.test import override_settings
from django.urls import include, path
from rest_framework.views import APIView

from django_idempotency import conf
from django_idempotency.core import task_runs
from django_idempotency.core.databases import behind_pooler
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.operations import checks
from django_idempotency.operations.checks import check_database, check_settings, check_views
from tests.conftest import BEHIND_PGBOUNCER

SOURCE = Path(checks.__file__).read_text() + Path(conf.__file__).read_text()


DJANGO_REDIS = "django.core.cache.backends.redis.RedisCache"
THIRD_PARTY_REDIS = "django_redis.cache.RedisCache"


def ids(messages):
    return [message.id for message in messages]


# Django 6.1's check command runs the database checks too.
@pytest.mark.django_db(databases="__all__")
def test_the_checks_are_registered_and_pass():
    call_command("check")  # raises SystemCheckError on any error


def test_check_ids_are_unique():
    found = re.findall(r'"(django_idempotency\.[EW]\d{3})"', SOURCE)
    assert len(found) == len(set(found))


@pytest.mark.django_db(databases="__all__")
@override_settings(IDEMPOTENCY={"TTL": 0})
def test_the_command_fails_on_a_bad_setting():
    from django.core.management.base import SystemCheckError  # noqa: PLC0415

    with pytest.raises(SystemCheckError, match="E006"):
        call_command("check")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (["TTL"], ["django_idempotency.E001"]),
        ({"TIMEOUT": 1}, ["django_idempotency.E002"]),
        ({"HEADER": "Bad Header"}, ["django_idempotency.E003"]),
        ({"KEY_REQUIRED": "yes"}, ["django_idempotency.E004"]),
        ({"METHODS": ["GET"]}, ["django_idempotency.E005"]),
        ({"METHODS": "POST"}, ["django_idempotency.E005"]),
        ({"METHODS": []}, ["django_idempotency.E005"]),
        ({"TTL": -5}, ["django_idempotency.E006"]),
        ({"TTL": "1d"}, ["django_idempotency.E006"]),
        ({"WAIT_TIMEOUT": -1}, ["django_idempotency.E007"]),
        ({"WAIT_TIMEOUT": True}, ["django_idempotency.E007"]),
        ({"SCOPE_FUNCTION": "no.such.function"}, ["django_idempotency.E008"]),
        ({"SCOPE_FUNCTION": 42}, ["django_idempotency.E008"]),
        ({"ANONYMOUS": "allow"}, ["django_idempotency.E009"]),
        ({"FINGERPRINT_HEADERS": "X-Tenant"}, ["django_idempotency.E010"]),
        ({"FINGERPRINT_HEADERS": ["bad header"]}, ["django_idempotency.E010"]),
        ({"RETRYABLE_STATUS_CODES": [99]}, ["django_idempotency.E011"]),
        ({"RETRYABLE_STATUS_CODES": 429}, ["django_idempotency.E011"]),
        ({"MODE": "optimistic"}, ["django_idempotency.E014"]),
        ({"LEASE_TIMEOUT": 0}, ["django_idempotency.E015"]),
        ({"CACHE": "no-such-cache"}, ["django_idempotency.E016"]),
        ({"INBOX_RUNNER": "rq"}, ["django_idempotency.E017"]),
        ({"INBOX_MAX_ATTEMPTS": 0}, ["django_idempotency.E018"]),
        ({"INBOX_MAX_ATTEMPTS": 2.5}, ["django_idempotency.E018"]),
        ({"INBOX_RETRY_DELAY": -1}, ["django_idempotency.E019"]),
        ({"INBOX_RETRY_MAX_DELAY": "1h"}, ["django_idempotency.E020"]),
        ({"INBOX_RETENTION": timedelta(0)}, ["django_idempotency.E021"]),
        ({"OUTBOX_RUNNER": None}, ["django_idempotency.E022"]),
        ({"OUTBOX_MAX_ATTEMPTS": True}, ["django_idempotency.E023"]),
        ({"OUTBOX_RETRY_DELAY": 0}, ["django_idempotency.E024"]),
        ({"OUTBOX_RETRY_MAX_DELAY": -timedelta(hours=1)}, ["django_idempotency.E025"]),
        ({"OUTBOX_RETENTION": "7d"}, ["django_idempotency.E026"]),
        ({"MAX_JSON_DEPTH": 0}, ["django_idempotency.E034"]),
        ({"MAX_JSON_DEPTH": conf.DEEPEST_JSON + 1}, ["django_idempotency.E034"]),
        ({"MAX_JSON_DEPTH": 31.0}, ["django_idempotency.E034"]),
        ({"MAX_JSON_DEPTH": True}, ["django_idempotency.E034"]),
        ({"DOWNSTREAM_KEY_NAMESPACE": None}, ["django_idempotency.E035"]),
        ({"DOWNSTREAM_KEY_NAMESPACE": b"payments"}, ["django_idempotency.E035"]),
        ({"TIMEOUT": 1, "TTL": 0}, ["django_idempotency.E002", "django_idempotency.E006"]),
    ],
)
def test_bad_settings(setting, expected):
    with override_settings(IDEMPOTENCY=setting):
        messages = check_settings()
    assert ids(messages) == expected
    assert all(message.hint for message in messages)


@pytest.mark.parametrize(
    "setting",
    [
        {},
        {"TTL": timedelta(days=3), "WAIT_TIMEOUT": 0, "METHODS": ("post", "PUT")},
        {"SCOPE_FUNCTION": lambda request, route: route, "ANONYMOUS": "reject"},
        {"FINGERPRINT_HEADERS": ["X-Tenant"], "RETRYABLE_STATUS_CODES": [429]},
        {"HEADER": "X-Idempotency-Key", "KEY_REQUIRED": False},
        {"INBOX_RUNNER": "celery", "INBOX_MAX_ATTEMPTS": 3, "INBOX_RETRY_DELAY": 5},
        {"OUTBOX_RUNNER": "celery", "OUTBOX_RETENTION": timedelta(days=1)},
        {"MAX_JSON_DEPTH": 1},
        {"MAX_JSON_DEPTH": conf.DEEPEST_JSON},
        {"DOWNSTREAM_KEY_NAMESPACE": "payments-production"},
    ],
)
def test_good_settings(setting):
    with override_settings(IDEMPOTENCY=setting):
        assert check_settings() == []


def test_an_unsupported_database_is_an_error(monkeypatch):
    assert check_database() == []
    monkeypatch.setattr(connection, "vendor", "oracle")
    assert ids(check_database()) == ["django_idempotency.E012"]


@pytest.mark.parametrize(
    ("is_mariadb", "version", "isolation", "expected"),
    [
        (True, (10, 11, 9), "read committed", []),
        (True, (10, 6, 0), "read committed", []),
        (True, (10, 11, 9), "repeatable read", ["django_idempotency.W006"]),
        (True, (10, 5, 20), "read committed", ["django_idempotency.E028"]),
        (False, (8, 4, 0), "read committed", ["django_idempotency.E028"]),
        (True, (10, 11, 9), "serializable", ["django_idempotency.W006"]),
    ],
)
def test_a_mariadb_server_is_checked_when_django_connects(
    monkeypatch, is_mariadb, version, isolation, expected
):
    from django_idempotency.operations.checks import check_mariadb  # noqa: PLC0415

    monkeypatch.setattr(connection, "vendor", "mysql")
    for name, value in [
        ("mysql_is_mariadb", is_mariadb),
        ("mysql_version", version),
        ("isolation_level", isolation),
    ]:
        monkeypatch.setattr(connection, name, value, raising=False)
    assert ids(check_mariadb(databases=["default"])) == expected
    assert check_mariadb(databases=None) == []  # `check` without --database connects to none


def test_an_old_sqlite_is_an_error(monkeypatch):
    monkeypatch.setattr(connection, "vendor", "sqlite")
    monkeypatch.setattr(connection.Database, "sqlite_version_info", (3, 31, 1), raising=False)
    monkeypatch.setattr(connection.Database, "sqlite_version", "3.31.1", raising=False)
    assert ids(check_database()) == ["django_idempotency.E013"]


def test_keys_in_another_database_than_the_views_are_warned_about(monkeypatch):
    from django.db import router  # noqa: PLC0415

    monkeypatch.setattr(router, "db_for_write", lambda model, **hints: "other")
    assert ids(check_database()) == ["django_idempotency.W002"]


def test_a_replay_cache_that_swallows_errors_is_warned_about():
    from django_idempotency.operations.checks import check_cache  # noqa: PLC0415

    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "replay": {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "OPTIONS": {"IGNORE_EXCEPTIONS": True},
        },
    }
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE": "replay"}):
        assert ids(check_cache()) == ["django_idempotency.W003"]
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE": "default"}):
        assert check_cache() == []
    assert check_cache() == []


@pytest.mark.parametrize(
    ("options", "project_wide", "warned"),
    [
        ({"IGNORE_EXCEPTIONS": True}, False, True),
        ({}, True, True),
        # The cache's own option wins over the project-wide one.
        ({"IGNORE_EXCEPTIONS": False}, True, False),
        ({}, False, False),
    ],
)
def test_w003_follows_what_django_redis_does_with_ignore_exceptions(options, project_wide, warned):
    from django_idempotency.operations.checks import check_cache  # noqa: PLC0415

    replay = {
        "BACKEND": THIRD_PARTY_REDIS,
        "LOCATION": "redis://127.0.0.1:6379/2",
        "OPTIONS": {"SOCKET_TIMEOUT": 0.5, **options},
    }
    caches_setting = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "replay": replay,
    }
    with override_settings(
        CACHES=caches_setting,
        IDEMPOTENCY={"CACHE": "replay"},
        DJANGO_REDIS_IGNORE_EXCEPTIONS=project_wide,
    ):
        assert ids(check_cache()) == (["django_idempotency.W003"] if warned else [])
        # What the backend itself does, read from the backend: no connection is made.
        assert django_caches["replay"]._ignore_exceptions is warned


def test_the_project_wide_ignore_exceptions_is_django_redis_s_alone():
    from django_idempotency.operations.checks import check_cache  # noqa: PLC0415

    caches_setting = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "replay": {
            "BACKEND": DJANGO_REDIS,
            "LOCATION": "redis://127.0.0.1:6379/2",
            "OPTIONS": {"socket_timeout": 0.5},
        },
    }
    with override_settings(
        CACHES=caches_setting,
        IDEMPOTENCY={"CACHE": "replay"},
        DJANGO_REDIS_IGNORE_EXCEPTIONS=True,
    ):
        assert check_cache() == []


@pytest.mark.parametrize(
    ("vendor", "depth", "expected"),
    [
        ("mysql", 32, ["django_idempotency.W007"] * 2),  # both aliases: default and other
        ("mysql", 64, ["django_idempotency.W007"] * 2),
        ("mysql", 31, []),
        ("mysql", None, []),  # the default
        ("mysql", 0, []),  # E034's to report
        ("postgresql", conf.DEEPEST_JSON, []),
        ("sqlite", conf.DEEPEST_JSON, []),
    ],
)
def test_a_json_depth_deeper_than_a_database_stores_is_warned_about(
    monkeypatch, vendor, depth, expected
):
    from django.db import connections  # noqa: PLC0415

    from django_idempotency.operations.checks import check_json_depth  # noqa: PLC0415

    for alias in connections:
        monkeypatch.setattr(connections[alias], "vendor", vendor)
    setting = {} if depth is None else {"MAX_JSON_DEPTH": depth}
    with override_settings(IDEMPOTENCY=setting):
        messages = check_json_depth()
    assert ids(messages) == expected
    assert all(f"IDEMPOTENCY['MAX_JSON_DEPTH'] is {depth}," in m.msg for m in messages)


def test_only_a_mariadb_alias_is_warned_about(monkeypatch):
    from django.db import connections  # noqa: PLC0415

    from django_idempotency.operations.checks import check_json_depth  # noqa: PLC0415

    monkeypatch.setattr(connections["default"], "vendor", "postgresql")
    monkeypatch.setattr(connections["other"], "vendor", "mysql")
    with override_settings(IDEMPOTENCY={"MAX_JSON_DEPTH": 40}):
        [warning] = check_json_depth()
    assert warning.id == "django_idempotency.W007"
    assert "'other' database refuses JSON nested deeper than 31 levels" in warning.msg
    assert warning.hint == "Use 31 or less, or remove it to use the default, 31."


@pytest.mark.parametrize(
    ("lease", "expected"),
    [
        (1, ["django_idempotency.W005"]),
        (timedelta(seconds=2.5), ["django_idempotency.W005"]),
        (3, []),
        (timedelta(minutes=1), []),
        (-1, []),  # E015's to report
    ],
)
def test_a_lease_too_short_to_survive_a_slow_renewal_is_warned_about(lease, expected):
    from django_idempotency.operations.checks import check_lease  # noqa: PLC0415

    with override_settings(IDEMPOTENCY={"LEASE_TIMEOUT": lease}):
        assert ids(check_lease()) == expected
    assert check_lease() == []


@pytest.mark.parametrize(
    ("replay", "warned"),
    [
        # The documented configuration: both timeouts.
        (
            {
                "BACKEND": DJANGO_REDIS,
                "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
            },
            False,
        ),
        # redis-py connects with the socket timeout when it has no connect timeout of its own.
        ({"BACKEND": DJANGO_REDIS, "OPTIONS": {"socket_timeout": 0.5}}, False),
        ({"BACKEND": DJANGO_REDIS, "LOCATION": "redis://r:6379/2?socket_timeout=0.5"}, False),
        ({"BACKEND": DJANGO_REDIS}, True),
        ({"BACKEND": DJANGO_REDIS, "OPTIONS": {"socket_connect_timeout": 0.5}}, True),
        ({"BACKEND": DJANGO_REDIS, "OPTIONS": {"socket_timeout": None}}, True),
        ({"BACKEND": DJANGO_REDIS, "OPTIONS": {"SOCKET_TIMEOUT": 0.5}}, True),
        # django-redis: its own option names, or the connection pool's.
        (
            {
                "BACKEND": THIRD_PARTY_REDIS,
                "OPTIONS": {"SOCKET_TIMEOUT": 0.5, "SOCKET_CONNECT_TIMEOUT": 0.5},
            },
            False,
        ),
        (
            {
                "BACKEND": THIRD_PARTY_REDIS,
                "OPTIONS": {"CONNECTION_POOL_KWARGS": {"socket_timeout": 0.5}},
            },
            False,
        ),
        ({"BACKEND": THIRD_PARTY_REDIS, "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5}}, True),
        ({"BACKEND": THIRD_PARTY_REDIS, "OPTIONS": {"socket_timeout": 0.5}}, True),
        ({"BACKEND": THIRD_PARTY_REDIS}, True),
        # django-redis drops a timeout of 0, and lets the pool's keyword arguments win.
        ({"BACKEND": THIRD_PARTY_REDIS, "OPTIONS": {"SOCKET_TIMEOUT": 0}}, True),
        (
            {
                "BACKEND": THIRD_PARTY_REDIS,
                "OPTIONS": {
                    "SOCKET_TIMEOUT": 0.5,
                    "CONNECTION_POOL_KWARGS": {"socket_timeout": None},
                },
            },
            True,
        ),
        (
            {"BACKEND": THIRD_PARTY_REDIS, "LOCATION": "redis://r:6379/2?socket_timeout=0.5"},
            False,
        ),
        (
            {
                "BACKEND": THIRD_PARTY_REDIS,
                "LOCATION": ["redis://r:6379/2?socket_timeout=0.5", "redis://s:6379/2"],
            },
            True,
        ),
        # Not a Redis client: nothing to say.
        ({"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}, False),
    ],
)
def test_a_redis_replay_cache_without_timeouts_is_warned_about(replay, warned, monkeypatch):
    from django_idempotency.operations.checks import check_cache  # noqa: PLC0415

    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "replay": {"LOCATION": "redis://127.0.0.1:6379/2", **replay},
    }
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE": "replay"}):
        assert ids(check_cache()) == (["django_idempotency.W004"] if warned else [])
        # The verdict agrees with what the backend hands redis-py, for every server.
        if (passed := passed_to_redis_py(django_caches["replay"], monkeypatch)) is not None:
            assert warned == any(kw.get("socket_timeout") is None for kw in passed), passed
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE": "default"}):
        assert check_cache() == []


def passed_to_redis_py(cache, monkeypatch):
    """The keyword arguments a Redis cache gives redis-py's connections, one dict per server;
    None for other caches. Builds the connection pools; connects to nothing."""
    from django.core.cache.backends.redis import RedisCache  # noqa: PLC0415
    from django_redis.cache import RedisCache as ThirdPartyRedisCache  # noqa: PLC0415
    from django_redis.pool import ConnectionFactory  # noqa: PLC0415

    if isinstance(cache, RedisCache):
        client = cache._cache  # builds each pool as its _get_connection_pool() does
        return [
            client._pool_class.from_url(server, **client._pool_options).connection_kwargs
            for server in client._servers
        ]
    if isinstance(cache, ThirdPartyRedisCache):
        # django-redis keeps its pools for the whole process, by URL alone.
        monkeypatch.setattr(ConnectionFactory, "_pools", {})
        return [
            cache.client.connect(index).connection_pool.connection_kwargs
            for index in range(len(cache.client._server))
        ]
    return None


def test_a_replay_cache_may_be_warned_about_twice():
    from django_idempotency.operations.checks import check_cache  # noqa: PLC0415

    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "replay": {"BACKEND": THIRD_PARTY_REDIS, "OPTIONS": {"IGNORE_EXCEPTIONS": True}},
    }
    with override_settings(CACHES=caches, IDEMPOTENCY={"CACHE": "replay"}):
        assert ids(check_cache()) == ["django_idempotency.W003", "django_idempotency.W004"]


# An idempotent view's options are checked at startup, not by its first request.


class MisspeltView(IdempotentMixin, APIView):
    idempotency_requried = True


class NegativeTtlView(IdempotentMixin, APIView):
    idempotency_ttl = -5


class GoodView(IdempotentMixin, APIView):
    idempotency_required = True
    idempotency_ttl = timedelta(hours=1)


@idempotent(mode="leased")
def misconfigured_function(request):
    return HttpResponse()


urlpatterns = [
    path("misspelt/", MisspeltView.as_view()),
    path("nested/", include([path("negative/", NegativeTtlView.as_view())])),
    path("again/", NegativeTtlView.as_view()),
    path("good/", GoodView.as_view()),
    path("function/", misconfigured_function),
]


@override_settings(ROOT_URLCONF=__name__)
def test_a_view_s_misspelt_or_wrong_options_fail_the_checks():
    messages = {(message.id, message.obj): message for message in check_views()}

    assert set(messages) == {
        ("django_idempotency.E032", MisspeltView),
        ("django_idempotency.E033", NegativeTtlView),  # once, though it is routed twice
        ("django_idempotency.E033", misconfigured_function),
    }
    misspelt = messages["django_idempotency.E032", MisspeltView]
    assert misspelt.msg == (
        "MisspeltView.idempotency_requried is not an idempotency option: it would be ignored."
    )
    assert misspelt.hint == "Did you mean idempotency_required?"
    negative = messages["django_idempotency.E033", NegativeTtlView].msg
    assert negative.startswith("NegativeTtlView's ttl option must be")
    assert negative.endswith("got -5.")
    assert "mode option must be" in messages["django_idempotency.E033", misconfigured_function].msg


def test_the_test_project_s_views_pass_the_view_checks():
    assert check_views() == []


# -- downstream keys without a namespace of the project --------------------------------------


class LeaseView(IdempotentMixin, APIView):
    idempotency_mode = "lease"


class AtomicView(IdempotentMixin, APIView):
    pass


@idempotent(mode="lease")
def lease_function(request):
    return HttpResponse()


@idempotent
def atomic_function(request):
    return HttpResponse()


def urlconf(*views):
    class URLConf:
        urlpatterns = [path(f"{index}/", view) for index, view in enumerate(views)]

    return URLConf


def ninja_urlconf(mode):
    from ninja import NinjaAPI  # noqa: PLC0415 - an optional extra

    from django_idempotency.ninja import idempotent as ninja_idempotent  # noqa: PLC0415

    api = NinjaAPI(urls_namespace=f"checks-ninja-{mode}")

    @api.post("/charges/")
    @ninja_idempotent(mode=mode)
    def charge(request):
        return {}

    class URLConf:
        urlpatterns = [path("api/", api.urls)]

    return URLConf


@pytest.fixture
def no_tasks(monkeypatch):
    """Forget the idempotent tasks that other test modules declared."""
    monkeypatch.setattr(task_runs, "DECLARED_TASKS", {})
    return task_runs.DECLARED_TASKS


LEASE_VIEW = (urlconf(LeaseView.as_view(), AtomicView.as_view()), {}, LeaseView)


@pytest.mark.parametrize(
    ("project", "expected"),
    [
        # A project without lease mode, as a fresh one: nothing to warn of.
        ((urlconf(AtomicView.as_view(), atomic_function), {}), None),
        ((urlconf(AtomicView.as_view()), {"DOWNSTREAM_KEY_NAMESPACE": ""}), None),
        (LEASE_VIEW[:2], LeaseView),
        ((urlconf(atomic_function, lease_function), {}), lease_function),
        # Views that follow the MODE setting.
        ((urlconf(AtomicView.as_view()), {"MODE": "lease"}), AtomicView),
        ((urlconf(atomic_function), {"MODE": "lease"}), atomic_function),
        ((urlconf(), {"MODE": "lease"}), None),  # but no view
        ((LEASE_VIEW[0], {"DOWNSTREAM_KEY_NAMESPACE": "payments-production"}), None),
    ],
)
def test_a_lease_mode_view_without_a_namespace_is_warned_about(no_tasks, project, expected):
    root, setting = project
    with override_settings(ROOT_URLCONF=root, IDEMPOTENCY=setting):
        messages = checks.check_downstream_namespace()
    assert [(message.id, message.obj) for message in messages] == (
        [] if expected is None else [("django_idempotency.W011", expected)]
    )
    assert all(message.hint and "never change it" in message.hint for message in messages)


def test_the_warning_names_the_first_and_counts_the_others(no_tasks):
    root = urlconf(LeaseView.as_view(), lease_function, AtomicView.as_view())
    with override_settings(ROOT_URLCONF=root, IDEMPOTENCY={}):
        (message,) = checks.check_downstream_namespace()
    assert message.msg.startswith("The lease-mode view LeaseView (and 1 more) gives a provider")


@pytest.mark.parametrize(("mode", "warned"), [("lease", True), ("atomic", False)])
def test_a_lease_mode_ninja_operation_without_a_namespace_is_warned_about(no_tasks, mode, warned):
    with override_settings(ROOT_URLCONF=ninja_urlconf(mode), IDEMPOTENCY={}):
        messages = checks.check_downstream_namespace()
    assert [message.msg.split(" gives")[0] for message in messages] == (
        ["The lease-mode operation ninja_urlconf.<locals>.charge"] if warned else []
    )


def test_an_idempotent_task_that_hands_out_its_key_is_warned_about(no_tasks):
    from django_idempotency.celery import idempotent_task  # noqa: PLC0415

    with override_settings(ROOT_URLCONF=urlconf(), IDEMPOTENCY={}):

        @idempotent_task(name="tests.checks.count", key=lambda n: n)
        def count(n):  # an atomic task whose body never sees its key
            return n

        assert checks.check_downstream_namespace() == []

        @idempotent_task(name="tests.checks.email", key=lambda n: n, mode="lease")
        def email(n):
            return n

        @idempotent_task(name="tests.checks.charge")
        def charge(n, idempotency_key):
            return idempotency_key.downstream_key

        (message,) = checks.check_downstream_namespace()
    assert message.msg.startswith("The lease-mode task tests.checks.email (and 1 more) gives")
    assert set(no_tasks) == {"tests.checks.count", "tests.checks.email", "tests.checks.charge"}


@pytest.mark.django_db(databases="__all__")
def test_the_namespace_check_is_registered(no_tasks, capsys):
    # The test project has lease-mode views; its settings give it a namespace.
    with override_settings(IDEMPOTENCY={}):
        call_command("check")
    assert "django_idempotency.W011" in capsys.readouterr().err
    assert checks.check_downstream_namespace() == []


# -- deployments: a pooler, an ASGI server ---------------------------------------------------


@pytest.mark.postgresql
@pytest.mark.django_db
def test_the_pooler_checks_ask_the_server_whether_a_pooler_is_in_between(monkeypatch):
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", False)

    found = ids(checks.check_pooler(databases=["default"]))

    assert behind_pooler(connection) is BEHIND_PGBOUNCER
    assert found == (["django_idempotency.W008"] if BEHIND_PGBOUNCER else [])


@pytest.mark.pgbouncer
@pytest.mark.django_db
def test_a_pooled_database_set_as_documented_passes_and_prepared_statements_do_not(monkeypatch):
    assert checks.check_pooler(databases=["default"]) == []

    options = {**connection.settings_dict.get("OPTIONS", {}), "server_side_binding": True}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    assert ids(checks.check_pooler(databases=["default"])) == ["django_idempotency.W009"]
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", {**options, "prepare_threshold": None})
    assert checks.check_pooler(databases=["default"]) == []


ASGI = "example.asgi.application"


@pytest.mark.parametrize(
    ("project", "expected"),
    [
        ((ASGI, 60, {}), ["django_idempotency.W010"]),
        ((ASGI, None, {}), ["django_idempotency.W010"]),  # None: connections never close
        ((ASGI, 0, {}), []),
        ((ASGI, 60, {"pool": True}), []),
        ((None, 60, {}), []),  # served over WSGI, as far as the settings tell
    ],
)
def test_persistent_connections_are_warned_of_in_a_project_served_over_asgi(
    settings, monkeypatch, project, expected
):
    settings.ASGI_APPLICATION, conn_max_age, options = project
    monkeypatch.setitem(settings.DATABASES["default"], "CONN_MAX_AGE", conn_max_age)
    monkeypatch.setitem(settings.DATABASES["default"], "OPTIONS", options)

    assert ids(checks.check_asgi_connections()) == expected


@pytest.mark.parametrize(("handler", "warned"), [(ASGIHandler, True), (WSGIHandler, False)])
def test_the_first_request_logs_the_warning_under_asgi_and_stops_listening(
    settings, monkeypatch, caplog, handler, warned
):
    # ASGI servers run no system checks: the app listens for the first request instead.
    monkeypatch.setitem(settings.DATABASES["default"], "CONN_MAX_AGE", 60)
    request_started.connect(checks.warn_of_asgi_connections)

    checks.warn_of_asgi_connections(sender=handler)

    assert caplog.text.count("django_idempotency.W010") == (1 if warned else 0)
    assert request_started.disconnect(checks.warn_of_asgi_connections) is False  # gone already
