"""The example project, set up for measuring the library rather than the example."""

from __future__ import annotations

import os

from example_project.settings import *  # noqa: F403

ROOT_URLCONF = "benchmarks.urls"
DEBUG = False
# Basic authentication hashes the password on every request; a fast hasher keeps that cost
# (the same in every scenario) from drowning the difference being measured.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING = {"version": 1, "disable_existing_loggers": False}
# Persistent connections, as in production under WSGI; a new connection per request would
# dominate. Not under ASGI (benchmarks/asgi.py says BENCH_ASGI): Django runs each request's
# queries in a thread of the request's own, which a persistent connection would outlive.
if not os.environ.get("BENCH_ASGI"):
    DATABASES["default"]["CONN_MAX_AGE"] = 600  # noqa: F405
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True  # noqa: F405
    # Served over WSGI alone: the check for persistent connections under ASGI does not apply.
    ASGI_APPLICATION = None

# The inbox hands events to Celery over Redis, as in production; no worker runs during the
# measurement, so what is measured is the ingest: verify, record once, enqueue. run.py serves
# the other runners ("inline", "database") from servers of their own, set by BENCH_INBOX_RUNNER.
IDEMPOTENCY = {**IDEMPOTENCY, "INBOX_RUNNER": os.environ.get("BENCH_INBOX_RUNNER", "celery")}  # noqa: F405
CELERY_BROKER_URL = f"redis://127.0.0.1:6379/{os.environ.get('BENCH_REDIS_DB', '13')}"
CELERY_TASK_ALWAYS_EAGER = False

# The replay cache of the cached-* scenarios' view (benchmarks/urls.py), as the example sets it up
# with REDIS_URL; the other views have none.
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "bench-replay": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": "redis://127.0.0.1:6379/15",
        "OPTIONS": {"SOCKET_TIMEOUT": 0.5, "SOCKET_CONNECT_TIMEOUT": 0.5},
    },
}
