"""The tables the core works on, handed in by the app config once the models are ready.

The core never imports the models (they sit above it): ``IdempotencyConfig.ready()`` hands the
key table in here, as Django's ``ModelBackend`` is handed the user model, and an engine built
without a store or a model reads it from here when it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django.db.models import Model

# The key table's scope and route columns: the models declare them with these lengths, and the
# core fits what it writes into them.
SCOPE_LENGTH = 512
ROUTE_LENGTH = 512

_tables: dict[str, type[Model]] = {}


def hand_in(*, keys: type[Model]) -> None:
    """Tell the core which model holds the idempotency keys."""
    _tables["keys"] = keys


def key_model() -> type[Model]:
    """The model of the idempotency keys, as the app config handed it in."""
    try:
        return _tables["keys"]
    except KeyError:
        msg = "django_idempotency is not ready: add it to INSTALLED_APPS"
        raise ImproperlyConfigured(msg) from None
