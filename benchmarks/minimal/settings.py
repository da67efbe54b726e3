"""Settings of the minimal project, as a user would write them after the installation guide."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

SECRET_KEY = "benchmark-only"  # noqa: S105 - a benchmark on loopback
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "benchmarks.minimal.urls"
WSGI_APPLICATION = "benchmarks.minimal.wsgi.application"
USE_TZ = True

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "rest_framework",
    "django_idempotency",
    "benchmarks.minimal",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# DATABASE_URL: postgres://user@host:port/name or mysql://user:password@host:port/name.
_url = urlsplit(os.environ["DATABASE_URL"])
DATABASES = {
    "default": {
        "ENGINE": {
            "postgres": "django.db.backends.postgresql",
            "mysql": "django.db.backends.mysql",
        }[_url.scheme],
        "NAME": _url.path.lstrip("/"),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "",
        "PORT": str(_url.port or ""),
        # Under ASGI (benchmarks/minimal/asgi.py), none, as Django advises: each request's
        # queries run in a thread of the request's own, which a persistent connection outlives.
        "CONN_MAX_AGE": 0 if os.environ.get("BENCH_ASGI") else 60,
        "OPTIONS": {"charset": "utf8mb4"} if _url.scheme == "mysql" else {},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# HTTP Basic hashes the password on every request: the fast hasher keeps that cost, the same in
# every scenario, from drowning the difference measured.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["rest_framework.authentication.BasicAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}

# The replay cache of the cached-* scenarios' views (views.py); the others have none.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "replay": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:6379/{os.environ.get('BENCH_CACHE_DB', '15')}",
        "OPTIONS": {"SOCKET_TIMEOUT": 0.5, "SOCKET_CONNECT_TIMEOUT": 0.5},
    },
}

WEBHOOK_SECRET = "whsec_minimal_benchmark"  # noqa: S105
# The inbox's requests only record; no worker runs while they are measured.
IDEMPOTENCY = {"INBOX_RUNNER": "database"}
LOGGING = {"version": 1, "disable_existing_loggers": False}
