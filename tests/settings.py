"""Test settings: SQLite by default, PostgreSQL with TEST_DATABASE=postgresql."""

from __future__ import annotations

import os
import sys
from importlib.util import find_spec
from typing import Any

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
ROOT_URLCONF = "tests.testapp.urls"
DEFAULT_AUTO_FIELD = os.environ.get("TEST_DEFAULT_AUTO_FIELD", "django.db.models.AutoField")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.messages",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_idempotency",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

if os.environ.get("TEST_DATABASE") == "postgresql":
    if os.environ.get("TEST_PG_DRIVER") == "psycopg2":
        # As where psycopg 3 is not installed: Django then falls back to psycopg2. Set before
        # Django loads its PostgreSQL backend, here and in the processes the tests start.
        sys.modules["psycopg"] = None  # type: ignore[assignment]
    DATABASES: dict[str, dict[str, Any]] = {
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "HOST": os.environ.get("PGHOST", "127.0.0.1"),
            "PORT": os.environ.get("PGPORT", "5432"),
            "USER": os.environ.get("PGUSER", "postgres"),
            "PASSWORD": os.environ.get("PGPASSWORD", ""),
            "NAME": os.environ.get("TEST_PG_NAME", "django_idempotency"),
        }
    }
    if pgbouncer_port := os.environ.get("TEST_PGBOUNCER_PORT"):
        # Through a PgBouncer in transaction pooling mode (runtests.py's PgBouncer pass), set
        # as the installation guide says, with a direct alias for the inbox workers to listen
        # on. PGHOST and PGPORT still name the server itself.
        DATABASES["direct"] = {**DATABASES["default"], "TEST": {"MIRROR": "default"}}
        DATABASES["default"].update(
            HOST="127.0.0.1", PORT=pgbouncer_port, DISABLE_SERVER_SIDE_CURSORS=True
        )
elif os.environ.get("TEST_DATABASE") == "mariadb":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.mysql",
            "HOST": os.environ.get("MARIADB_HOST", "127.0.0.1"),
            "PORT": os.environ.get("MARIADB_PORT", "3306"),
            "USER": os.environ.get("MARIADB_USER", "root"),
            "PASSWORD": os.environ.get("MARIADB_PASSWORD", ""),
            "NAME": os.environ.get("TEST_MARIADB_NAME", "django_idempotency"),
            "OPTIONS": {
                "charset": "utf8mb4",
                # Django's default, or MariaDB's own ("repeatable read"), which CI also runs.
                "isolation_level": os.environ.get("TEST_MARIADB_ISOLATION", "read committed"),
            },
            "TEST": {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"},
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": ":memory:",
            "TEST": {"NAME": os.environ.get("TEST_SQLITE_NAME")},
        }
    }

# An alias for the routing checks; in tests it mirrors the default database.
DATABASES["other"] = {**DATABASES["default"], "TEST": {"MIRROR": "default"}}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
TEST_WEBHOOK_SECRETS = ["whsec_dGVzdHMtb25seS1uZXctc2VjcmV0", "tests-only-old-secret"]

# The test project has lease-mode views: its downstream keys carry a namespace of its own, as
# every project's that shares a provider account should (W011). Tests that override IDEMPOTENCY
# run without one.
IDEMPOTENCY: dict[str, Any] = {"DOWNSTREAM_KEY_NAMESPACE": "django-idempotency-tests"}
# For relays that a test kills over and over: their messages are not to run out of attempts.
if attempts := os.environ.get("TEST_OUTBOX_MAX_ATTEMPTS"):
    IDEMPOTENCY["OUTBOX_MAX_ATTEMPTS"] = int(attempts)

# Django's Tasks framework (django.tasks from Django 6.0, the django_tasks backport before it):
# the immediate backend runs a task where it is enqueued; django-tasks-db's backend keeps it for
# its db_worker, which the worker tests start.
_TASKS_PACKAGE = "django.tasks" if find_spec("django.tasks") else "django_tasks"
TASKS: dict[str, dict[str, Any]] = {
    "default": {"BACKEND": f"{_TASKS_PACKAGE}.backends.immediate.ImmediateBackend"}
}
if find_spec(_TASKS_PACKAGE) and find_spec("django_tasks_db"):
    INSTALLED_APPS.append("django_tasks_db")
    TASKS["database"] = {"BACKEND": "django_tasks_db.DatabaseBackend"}
