"""The ``django_idempotency.client`` package: its public names, and its optional imports."""

from __future__ import annotations

import importlib.util
import inspect
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

import django_idempotency
from django_idempotency import client
from django_idempotency.client import RetryPolicy


def load_client(monkeypatch, *missing):
    """Import the client package afresh, with ``missing`` modules not installed."""
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)
    package = client.__name__
    for name in [name for name in sys.modules if name.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, package)
    # The import binds the fresh package to its parent's attribute: the test's end restores it.
    monkeypatch.setattr(django_idempotency, "client", client)
    return importlib.import_module(package)


def test_public_names_are_imported_from_the_package_and_tell_where_they_are_defined():
    # Which names are public: tests/test_public_names.py. The package is their one import
    # path; it no longer passes them off as its own, so inspect finds their source.
    for name in client.__all__:
        value = getattr(client, name)
        if callable(value):
            assert value.__module__.startswith("django_idempotency.client._"), name
            assert name in inspect.getsource(sys.modules[value.__module__]), name
    assert repr(RetryPolicy().budget).startswith("<django_idempotency.client._budgets.RetryBudgets")
    assert {"IDEMPOTENT_METHODS", "KEYED_METHODS", "Jitter", "logger"} <= set(vars(client))


def test_the_module_imports_without_httpx(monkeypatch):
    module = load_client(monkeypatch, "httpx")
    assert hasattr(module, "RetryAdapter")
    for name in ("RetryTransport", "AsyncRetryTransport", "retrying_client"):
        with pytest.raises(ImproperlyConfigured, match=f"{name} needs httpx.*pip install httpx"):
            getattr(module, name)
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_module_imports_without_requests(monkeypatch):
    module = load_client(monkeypatch, "requests", "requests.adapters")
    assert hasattr(module, "RetryTransport")
    for name in ("RetryAdapter", "retrying_session"):
        with pytest.raises(ImproperlyConfigured, match=f"{name} needs requests.*install requests"):
            getattr(module, name)


def test_the_module_needs_tenacity(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match=r'pip install "django-idempotency\[client\]"'):
        load_client(monkeypatch, "tenacity")
