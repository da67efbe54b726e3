from __future__ import annotations

import os
import sys

import pytest
from django.apps import apps
from django.db import connection

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


@pytest.mark.postgresql
def test_the_postgresql_pass_runs_on_the_driver_it_names():
    # runtests.py runs the PostgreSQL tests once with psycopg 3, once with psycopg2.
    assert connection.Database.__name__ == os.environ.get("TEST_PG_DRIVER", "psycopg")
