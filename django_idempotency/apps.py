from __future__ import annotations

import importlib.util

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class IdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_idempotency import checks  # noqa: F401, PLC0415 - registers the checks

        if importlib.util.find_spec("drf_spectacular") is not None:
            # Registers the schema extension: idempotent views document themselves.
            from django_idempotency import openapi  # noqa: F401, PLC0415
