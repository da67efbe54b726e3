"""A Celery app for the task tests: a real worker over the Redis broker on loopback."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery(
    "tests",
    broker="redis://127.0.0.1:6379/14",
    backend="redis://127.0.0.1:6379/14",
    include=["django_idempotency.tasks"],
)
app.conf.task_default_queue = "django-idempotency-tests"
