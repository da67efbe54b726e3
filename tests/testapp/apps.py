from __future__ import annotations

from django.apps import AppConfig


class TestAppConfig(AppConfig):
    name = "tests.testapp"
    label = "testapp"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        from tests.testapp import webhooks  # noqa: F401, PLC0415 - registers the inbox handlers
