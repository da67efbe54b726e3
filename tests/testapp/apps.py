from __future__ import annotations

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        # Register the inbox handlers and outbox dispatchers.
        from tests.testapp import outbox, webhooks  # noqa: F401, PLC0415
