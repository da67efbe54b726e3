from __future__ import annotations

import sys

import pytest
from django.apps import apps

from tests.libraries import without


def ready() -> None:
    apps.get_app_config("django_idempotency").ready()


@pytest.mark.parametrize(
    ("library", "integration"),
    [
        ("opentelemetry", "tracing"),
        ("prometheus_client", "metrics"),
        ("drf_spectacular", "openapi"),
        ("rest_framework", "openapi"),
    ],
)
def test_the_app_starts_without_an_optional_library(library, integration):
    with without(library):
        ready()
        assert f"django_idempotency.{integration}" not in sys.modules


def test_the_app_starts_without_any_optional_library():
    with without("opentelemetry", "prometheus_client", "drf_spectacular", "rest_framework"):
        ready()
        loaded = {"tracing", "metrics", "openapi"} & {
            name.removeprefix("django_idempotency.") for name in sys.modules
        }
        assert loaded == set()
