"""The example's Celery app: ``celery -A example_project worker --beat`` runs the cleanup tasks.

Without CELERY_BROKER_URL in the environment, tasks run eagerly in the calling process, so the
example needs no broker; set it (for example redis://127.0.0.1:6379/0) to use a real worker.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["django_idempotency", "payments"])
