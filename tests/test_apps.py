from __future__ import annotations

import os
import sys

import pytest
from django.apps import apps
from django.db import connection

from tests.libraries import without


def ready() -> None:
    apps.get_app_config("django_idempotency").ready()


# The modules the app loads when their library is installed.
INTEGRATIONS = {
    "opentelemetry": "django_idempotency.operations.tracing",
    "prometheus_client": "django_idempotency.operations.metrics",
    "drf_spectacular": "django_idempotency.openapi",
    "rest_framework": "django_idempotency.openapi",
}


@pytest.mark.parametrize(("library", "integration"), INTEGRATIONS.items())
def test_the_app_starts_without_an_optional_library(library, integration):
    with without(library):
        ready()
        assert integration not in sys.modules


def test_the_app_starts_without_any_optional_library():
    with without(*INTEGRATIONS):
        ready()
        assert not set(INTEGRATIONS.values()) & set(sys.modules)


@pytest.mark.postgresql
def test_the_postgresql_pass_runs_on_the_driver_it_names():
    # runtests.py runs the PostgreSQL tests once with psycopg 3, once with psycopg2.
    assert connection.Database.__name__ == os.environ.get("TEST_PG_DRIVER", "psycopg")
