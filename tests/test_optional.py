"""Without an optional library, the package starts, and using what needs it names the extra."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import types
import uuid

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import JsonResponse
from django.test import RequestFactory

from django_idempotency.core.optional import EXTRAS, installed
from tests.libraries import IMPORTED_BY, without


@pytest.mark.parametrize(
    ("module", "library", "extra"),
    [
        ("drf", "rest_framework", "drf"),
        ("openapi", "drf_spectacular", "openapi"),
        ("ninja", "ninja", "ninja"),
        ("tasks", "celery", "celery"),
        ("celery", "celery", "celery"),
        pytest.param(
            "django_tasks",
            "django_tasks",
            "tasks",
            marks=pytest.mark.skipif(
                installed("django.tasks"), reason="Django 6.0+ ships the framework"
            ),
        ),
        ("brokers", "kombu", "brokers"),
        ("client", "tenacity", "client"),
        ("operations.metrics", "prometheus_client", "metrics"),
        ("operations.tracing", "opentelemetry", "tracing"),
    ],
)
def test_a_module_imported_without_its_library_names_the_extra(module, library, extra):
    with without(library), pytest.raises(ImproperlyConfigured) as raised:
        importlib.import_module(f"django_idempotency.{module}")
    message = str(raised.value)
    assert f'pip install "django-idempotency[{extra}]"' in message
    assert EXTRAS[extra].requirement in message
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)


def test_an_import_error_from_an_installed_library_is_not_blamed_on_the_extra():
    from django_idempotency.core.optional import requires  # noqa: PLC0415

    with pytest.raises(ImportError, match="cannot import name"), requires("drf", "somewhere"):
        from rest_framework import no_such_name  # noqa: F401, PLC0415


@pytest.mark.parametrize(
    ("module", "installed_answer"),
    [
        ("rest_framework", True),
        ("opentelemetry.trace", True),
        ("opentelemetry.no_such_module", False),
        ("no_such_library", False),
        ("no_such_library.trace", False),
    ],
)
def test_installed_answers_without_raising(module, installed_answer):
    assert installed(module) is installed_answer


def test_installed_answers_false_for_a_hidden_library():
    with without("opentelemetry"):
        assert installed("opentelemetry.trace") is False


def test_the_test_client_without_drf_names_the_extra():
    with without("rest_framework"):
        testing = importlib.import_module("django_idempotency.testing")
        with pytest.raises(ImproperlyConfigured, match=r"django-idempotency\[drf\]"):
            testing.IdempotentAPIClient()


@pytest.mark.django_db
def test_a_plain_view_is_idempotent_without_drf():
    with without("rest_framework"):
        from django_idempotency.decorators import idempotent  # noqa: PLC0415

        @idempotent
        def create(request):
            return JsonResponse({"id": str(uuid.uuid4())}, status=201)

        factory = RequestFactory()
        headers = {"Idempotency-Key": str(uuid.uuid4())}
        first = create(factory.post("/things/", {"a": 1}, "application/json", headers=headers))
        again = create(factory.post("/things/", {"a": 1}, "application/json", headers=headers))
    assert first.status_code == again.status_code == 201
    assert json.loads(again.content) == json.loads(first.content)
    assert again["Idempotency-Status"] == "replayed"


def test_the_celery_dispatcher_without_celery_names_the_extra():
    from django_idempotency.models import OutboxMessage  # noqa: PLC0415
    from django_idempotency.outbox.dispatchers import CeleryTaskDispatcher  # noqa: PLC0415

    message = OutboxMessage(topic="payments.deliver", payload={})
    with without("celery"), pytest.raises(ImproperlyConfigured, match=r"\[celery\]"):
        CeleryTaskDispatcher("payments.deliver")(message)


def test_the_webhook_dispatcher_without_httpx_names_it():
    from django_idempotency.outbox.dispatchers import WebhookDispatcher  # noqa: PLC0415

    dispatcher = WebhookDispatcher("https://example.invalid/hook", "whsec_dGVzdHMtb25seQ==")
    message = r'needs httpx.*pip install "django-idempotency\[client\]" httpx'
    with without("httpx"), pytest.raises(ImproperlyConfigured, match=message):
        dispatcher.client  # noqa: B018


# A fresh interpreter with every optional library hidden: what a plain install sees.
PLAIN_INSTALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    for library in {libraries!r}:
        sys.modules[library] = None

    import django
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import call_command

    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
            "django.contrib.sessions", "django.contrib.messages", "django_idempotency",
        ],
        DATABASES={{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}}},
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        TEMPLATES=[{{
            "BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
            "OPTIONS": {{"context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]}},
        }}],
        ROOT_URLCONF=__name__,
        SECRET_KEY="not-secret",
    )
    django.setup()
    from django.contrib import admin
    from django.urls import path
    urlpatterns = [path("admin/", admin.site.urls)]
    call_command("check", fail_level="WARNING")
    call_command("migrate", verbosity=0)

    import django_idempotency
    outcome = {{}}
    # A package whose extra is missing (the client) fails again when the walk looks inside it:
    # onerror lets the walk go on, and the loop has recorded the error already.
    walk = pkgutil.walk_packages(
        django_idempotency.__path__, "django_idempotency.", onerror=lambda name: None
    )
    for module in walk:
        if "._" in module.name or ".migrations" in module.name:
            continue
        try:
            importlib.import_module(module.name)
        except ImproperlyConfigured as exc:
            outcome[module.name] = str(exc)
        else:
            outcome[module.name] = "imported"
    print(json.dumps(outcome))
    """
)


def test_a_plain_install_starts_checks_migrates_and_imports():
    libraries = sorted({*IMPORTED_BY, "psycopg", "psycopg2", "redis", "django_redis", "kombu"})
    completed = subprocess.run(
        [sys.executable, "-c", PLAIN_INSTALL.format(libraries=libraries)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    outcome = json.loads(completed.stdout.splitlines()[-1])
    needs = {
        "django_idempotency.drf": "drf",
        "django_idempotency.drf_errors": "drf",
        "django_idempotency.openapi": "openapi",
        "django_idempotency.ninja": "ninja",
        "django_idempotency.tasks": "celery",
        "django_idempotency.celery": "celery",
        "django_idempotency.brokers": "brokers",
        "django_idempotency.client": "client",
        "django_idempotency.metrics": "metrics",
        "django_idempotency.operations.metrics": "metrics",
        "django_idempotency.operations.tracing": "tracing",
    }
    if not installed("django.tasks"):  # Django 6.0+ ships the Tasks framework
        needs["django_idempotency.django_tasks"] = "tasks"
    for module, result in outcome.items():
        if module in needs:
            assert f'pip install "django-idempotency[{needs[module]}]"' in result, module
        else:
            assert result == "imported", (module, result)
    assert {"django_idempotency.admin", "django_idempotency.testing"} <= set(outcome)
    assert set(needs) <= set(outcome)


def test_installed_answers_true_for_a_library_that_replaced_its_module(monkeypatch):
    # kombu and celery, once imported, replace their module with one whose __spec__ is None.
    replaced = types.ModuleType("replaced_library")
    assert replaced.__spec__ is None
    monkeypatch.setitem(sys.modules, "replaced_library", replaced)
    assert installed("replaced_library")
