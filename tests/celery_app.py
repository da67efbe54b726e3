"""A Celery app for the task tests: a real worker over the Redis broker on loopback."""

from __future__ import annotations

import os
import uuid

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

# Parallel runs on one machine keep apart by giving each its own database.
REDIS_URL = f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_CELERY_DB', '14')}"

app = Celery(
    "tests",
    broker=REDIS_URL,
    backend=REDIS_URL,
    include=["django_idempotency.tasks"],
)
# A queue of each test run's own (a worker it starts inherits the name), so that no run's
# workers take, or purge, another run's tasks.
app.conf.task_default_queue = os.environ.setdefault(
    "TEST_CELERY_QUEUE", f"django-idempotency-tests-{uuid.uuid4().hex}"
)
