"""Settings for the example project: a small payments API made safe to retry.

SQLite by default (``db.sqlite3`` next to ``manage.py``). Set ``DATABASE_URL`` to a
``postgres://user:password@host:port/name`` URL to use PostgreSQL instead, or to a
``mysql://user:password@host:port/name`` URL to use MariaDB (with the ``mariadb`` extra).
"""

from __future__ import annotations

import os
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

# An example, not a deployment: never use this key, or DEBUG, in production.
SECRET_KEY = os.environ.get("SECRET_KEY", "django-insecure-example-project-only")
DEBUG = os.environ.get("DEBUG", "true").lower() in {"1", "true", "yes", "on"}
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "ninja",  # the templates and static files of its interactive docs
    "django_idempotency",
    "payments",
]

MIDDLEWARE = [
    # First, so a caller's Request-Timeout-Ms counts from the moment the request arrives.
    "django_idempotency.guard.RetryGuardMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
WSGI_APPLICATION = "example_project.wsgi.application"
ASGI_APPLICATION = "example_project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


# Django's backend for each scheme DATABASE_URL may have.
DATABASE_ENGINES = {
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
}


def database_from_url(url: str) -> dict[str, Any]:
    """Turn ``postgres://`` or ``mysql://user:password@host:port/name`` into a DATABASES entry."""
    parts = urlsplit(url)
    if parts.scheme not in DATABASE_ENGINES:
        msg = f"DATABASE_URL must be a postgres:// or mysql:// URL, not {parts.scheme!r}."
        raise ImproperlyConfigured(msg)
    database: dict[str, Any] = {
        "ENGINE": DATABASE_ENGINES[parts.scheme],
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
    if parts.scheme == "mysql":
        # Said, not left to a default: keys and bodies may hold any character, and utf8mb3 has no
        # room for four-byte ones such as emoji.
        database["OPTIONS"] = {"charset": "utf8mb4"}
    return database


if database_url := os.environ.get("DATABASE_URL"):
    DATABASES = {"default": database_from_url(database_url)}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": BASE_DIR / "db.sqlite3",
            "OPTIONS": {
                # SQLite runs one write transaction at a time. A transaction that begins as a
                # reader and then writes fails at once ("database is locked") when another
                # writer holds the lock; IMMEDIATE takes the lock as each transaction begins,
                # so concurrent requests wait their turn instead.
                "transaction_mode": "IMMEDIATE",
                # Seconds a transaction waits for that turn.
                "timeout": 20,
            },
            # A file, not the in-memory default: the demo's concurrent story runs threads,
            # each with its own connection.
            "TEST": {"NAME": BASE_DIR / "test_db.sqlite3"},
        },
        # The stand-in provider's records, in a database of their own as a provider's are: a
        # lease-mode view holds SQLite's write lock on "default" while it calls the provider.
        # `manage.py migrate` (and the demo) migrate both.
        "provider": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": BASE_DIR / "provider.sqlite3",
            "OPTIONS": {"timeout": 20},
            "TEST": {"NAME": BASE_DIR / "test_provider.sqlite3"},
        },
    }
DATABASE_ROUTERS = ["payments.provider.LedgerRouter"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.BasicAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # DRF's own JSON parser answers 500 to JSON nested a few thousand levels deep; this one
    # answers 400, with a key or without.
    "DEFAULT_PARSER_CLASSES": [
        "django_idempotency.drf.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 20,
    # The OpenAPI schema at /api/schema/: idempotent and conditional operations document their
    # headers and answers by themselves.
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {"TITLE": "Payments API", "VERSION": "1.0.0"}

# Every key is optional; these show the defaults.
IDEMPOTENCY = {
    # How long a stored response can be replayed.
    "TTL": timedelta(hours=24),
    # How long, in seconds, a duplicate waits for the first request before answering 409.
    "WAIT_TIMEOUT": 3.0,
    # Whether a request to an idempotent view must carry a key (400 if missing).
    "KEY_REQUIRED": True,
    # Part of every key the card provider is given: another service or environment on the same
    # provider account must have its own. Set once, before going live: it changes every key.
    "DOWNSTREAM_KEY_NAMESPACE": "example-payments",
    # Webhook inbox: processed by a Celery worker when there is a broker, else in the request.
    "INBOX_RUNNER": "celery" if "CELERY_BROKER_URL" in os.environ else "inline",
    # Attempts before an event is dead and waits for a person in the admin.
    "INBOX_MAX_ATTEMPTS": 10,
    # Outbox: relayed by a Celery worker when there is a broker, else right after the commit.
    "OUTBOX_RUNNER": "celery" if "CELERY_BROKER_URL" in os.environ else "inline",
}

# A lease shorter than the default, in seconds: for tests that serve this project over HTTP
# (tests/blackbox/) and make a request outlive its lease.
if lease_timeout := os.environ.get("EXAMPLE_LEASE_TIMEOUT"):
    IDEMPOTENCY["LEASE_TIMEOUT"] = timedelta(seconds=float(lease_timeout))

# With REDIS_URL set (redis://host:port/db), replays are served from Redis before the database.
if redis_url := os.environ.get("REDIS_URL"):
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "idempotency": {
            # django-redis; Django's own backend works too, with "BACKEND":
            # "django.core.cache.backends.redis.RedisCache" and the same timeouts under
            # redis-py's names: "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5}.
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": redis_url,
            # Seconds: without them, a Redis that stops answering holds every request.
            "OPTIONS": {"SOCKET_TIMEOUT": 0.5, "SOCKET_CONNECT_TIMEOUT": 0.5},
        },
    }
    IDEMPOTENCY["CACHE"] = "idempotency"

# Where the outbox sends our payment events (here: back to this project's own inbox, as to another
# service), and the secrets they are signed with.
PAYMENT_EVENTS_URL = os.environ.get(
    "PAYMENT_EVENTS_URL", "http://127.0.0.1:8000/webhooks/payments/"
)
PAYMENT_EVENTS_SECRETS = os.environ.get(
    "PAYMENT_EVENTS_SECRETS", "whsec_ZXhhbXBsZS1wcm9qZWN0LW9ubHk="
).split(",")

# With PAYMENT_EVENTS_BROKER_URL set (amqp://... or redis://...), the outbox publishes the payment
# events to that broker's "payment-events" exchange instead, and another service (here: this
# project again) consumes them from its own queue:
#   manage.py idempotency_consume payment-receipts --broker "$PAYMENT_EVENTS_BROKER_URL" \
#       --exchange payment-events --routing-key "payment.*" --source payments
PAYMENT_EVENTS_BROKER_URL = os.environ.get("PAYMENT_EVENTS_BROKER_URL", "")

# The secrets the provider signs its webhooks with: the current one first, then the one it
# replaces while a rotation is under way.
PROVIDER_WEBHOOK_SECRETS = os.environ.get(
    "PROVIDER_WEBHOOK_SECRETS", "whsec_example-project-only"
).split(",")

# /metrics/ answers staff, and a scraper that sends "Authorization: Bearer <this token>".
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")

# Django's Tasks framework (django.tasks from Django 6.0, the django-tasks backport before it):
# the immediate backend runs each task where it is enqueued, with no worker.
TASKS = {
    "default": {
        "BACKEND": ("django.tasks" if find_spec("django.tasks") else "django_tasks")
        + ".backends.immediate.ImmediateBackend"
    }
}

# Print each idempotency decision (stored, replayed, mismatch, ...) on the console.
# Celery: eager (no broker) unless CELERY_BROKER_URL is set. The beat schedule is the one the
# operations docs recommend for django-idempotency.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "memory://")
CELERY_TASK_ALWAYS_EAGER = "CELERY_BROKER_URL" not in os.environ
CELERY_BEAT_SCHEDULE = {
    "purge-expired-idempotency-keys": {
        "task": "django_idempotency.purge_expired_keys",
        "schedule": timedelta(minutes=5),
        "kwargs": {"max_seconds": 240},
    },
    "sweep-idempotency-leases": {
        "task": "django_idempotency.sweep_expired_leases",
        "schedule": timedelta(minutes=1),
    },
    "dispatch-due-inbox-events": {
        "task": "django_idempotency.dispatch_due_inbox_events",
        "schedule": timedelta(minutes=1),
    },
    "purge-processed-inbox-events": {
        "task": "django_idempotency.purge_processed_inbox_events",
        "schedule": timedelta(hours=1),
    },
    "relay-outbox": {
        "task": "django_idempotency.relay_outbox",
        "schedule": timedelta(seconds=10),
    },
    "purge-dispatched-outbox-messages": {
        "task": "django_idempotency.purge_dispatched_outbox_messages",
        "schedule": timedelta(hours=1),
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_idempotency": {"handlers": ["console"], "level": "INFO"}},
}
