"""The example project: a payments API that uses django-idempotency."""

from __future__ import annotations

from example_project.celery import app as celery_app

__all__ = ["celery_app"]
