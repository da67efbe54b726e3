"""Optional libraries: probing one never raises, and a missing one names the extra to install."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import TYPE_CHECKING, NamedTuple

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from collections.abc import Iterator


class Extra(NamedTuple):
    module: str  # what is probed
    requirement: str  # what pip installs


# The extras of pyproject.toml whose library the package imports.
EXTRAS: dict[str, Extra] = {
    "drf": Extra("rest_framework", "djangorestframework"),
    "celery": Extra("celery", "celery"),
    # Django's Tasks framework before Django 6.0, which ships it as django.tasks.
    "tasks": Extra("django_tasks", "django-tasks"),
    "brokers": Extra("kombu", "kombu"),
    "client": Extra("tenacity", "tenacity"),
    "openapi": Extra("drf_spectacular", "drf-spectacular"),
    "ninja": Extra("ninja", "django-ninja"),
    "metrics": Extra("prometheus_client", "prometheus-client"),
    # opentelemetry is a namespace package that many distributions share; the API owns .trace.
    "tracing": Extra("opentelemetry.trace", "opentelemetry-api"),
}


def installed(module: str) -> bool:
    """Whether ``module`` (a dotted name) can be imported; imports at most its parent packages."""
    # find_spec("a.b") imports "a", and raises ModuleNotFoundError when "a" is missing: probe each
    # parent first, so that a missing one answers False.
    name = ""
    for part in module.split("."):
        name = f"{name}.{part}" if name else part
        if name in sys.modules:
            # Imported already (kombu and celery then replace their module with one whose
            # __spec__ is None), or blocked by a None.
            if sys.modules[name] is None:
                return False
            continue
        try:
            if importlib.util.find_spec(name) is None:
                return False
        except (ImportError, ValueError):  # ValueError: a module whose __spec__ is None
            return False
    return True


def missing(extra: str, needed_by: str) -> ImproperlyConfigured:
    """The error for ``needed_by`` used without the library that ``extra`` installs."""
    return ImproperlyConfigured(
        f"{needed_by} needs {EXTRAS[extra].requirement}, which is not installed: "
        f'pip install "django-idempotency[{extra}]"'
    )


@contextlib.contextmanager
def requires(name: str, needed_by: str) -> Iterator[None]:
    """Turn the ImportError of an absent optional library into an error naming its extra.

    An ImportError raised while the library *is* installed (a broken install, an incompatible
    version) is left as it is: installing the extra would not fix it.
    """
    try:
        yield
    except ImportError as exc:
        if installed(EXTRAS[name].module):
            raise
        raise missing(name, needed_by) from exc
