"""Run code as if an optional library were not installed."""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

# The package's modules that import each optional library, directly or through another one.
IMPORTED_BY = {
    "rest_framework": ("drf", "openapi", "testing"),
    "drf_spectacular": ("openapi",),
    "ninja": ("ninja",),
    "celery": ("tasks", "celery"),
    # Before Django 6.0, which ships the framework as django.tasks.
    "django_tasks": ("django_tasks",),
    "kombu": ("brokers",),
    "tenacity": ("client",),
    "httpx": ("client",),
    "requests": ("client",),
    "prometheus_client": ("operations.metrics", "metrics"),
    "opentelemetry": ("operations.tracing",),
}


@contextlib.contextmanager
def without(*libraries: str):
    """Make ``libraries`` (top-level names) unimportable, and their importers import afresh.

    A ``None`` in ``sys.modules`` is what Python itself uses to block an import: importing the
    library, or any module under it, raises ModuleNotFoundError, and ``find_spec`` of its name
    answers None. Everything is put back on exit.
    """
    packages = ("django_idempotency", "django_idempotency.operations")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(sys.modules))
        for package in packages:
            stack.enter_context(mock.patch.dict(sys.modules[package].__dict__))
        for name in list(sys.modules):
            if name.partition(".")[0] in libraries:
                del sys.modules[name]
        importers = {
            f"django_idempotency.{m}" for lib in libraries for m in IMPORTED_BY.get(lib, ())
        }
        for name in list(sys.modules):
            # A package's modules too (the client is one), or its import would find them ready.
            if name in importers or name.rpartition(".")[0] in importers:
                del sys.modules[name]
        for library in libraries:
            sys.modules[library] = None  # type: ignore[assignment]
            for module in IMPORTED_BY.get(library, ()):
                parent, _, name = f"django_idempotency.{module}".rpartition(".")
                sys.modules[parent].__dict__.pop(name, None)
        yield
