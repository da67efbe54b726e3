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

        # Each optional integration loads when its library is installed.
        if importlib.util.find_spec("drf_spectacular") and importlib.util.find_spec(
            "rest_framework"
        ):
            # Registers the schema extension: idempotent views document themselves.
            from django_idempotency import openapi  # noqa: F401, PLC0415
        if importlib.util.find_spec("prometheus_client") is not None:
            from django_idempotency import metrics  # noqa: F401, PLC0415
        if importlib.util.find_spec("opentelemetry.trace") is not None:
            from django_idempotency import tracing  # noqa: F401, PLC0415
