from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _

from django_idempotency.core import tables
from django_idempotency.core.optional import installed


class IdempotencyConfig(AppConfig):
    name = "django_idempotency"
    verbose_name = _("Idempotency")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core.signals import request_started  # noqa: PLC0415

        from django_idempotency.models import IdempotencyKey  # noqa: PLC0415 - needs the registry

        # The core works on the key table without importing the models, which sit above it.
        tables.hand_in(keys=IdempotencyKey)

        from django_idempotency.operations import checks  # noqa: PLC0415 - registers the checks

        # ASGI servers run no system checks: the first request tells of W010 instead.
        request_started.connect(checks.warn_of_asgi_connections)

        # Each optional integration loads when its library is installed.
        if installed("drf_spectacular") and installed("rest_framework"):
            # Registers the schema extension: idempotent views document themselves.
            from django_idempotency import openapi  # noqa: F401, PLC0415
        if installed("prometheus_client"):
            from django_idempotency.operations import metrics  # noqa: F401, PLC0415
        if installed("opentelemetry.trace"):
            from django_idempotency.operations import tracing  # noqa: F401, PLC0415
