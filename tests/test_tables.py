"""The key table handed to the core by the app config, and an engine handed a table of its own."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_idempotency.core import tables
from django_idempotency.core.engine import Engine
from django_idempotency.core.operation import Answer
from django_idempotency.core.outcomes import Outcome
from django_idempotency.core.tables import ROUTE_LENGTH, SCOPE_LENGTH
from django_idempotency.models import IdempotencyKey
from tests.test_engine import Greeting


def test_the_app_config_hands_the_key_table_to_the_core():
    assert tables.key_model() is IdempotencyKey


def test_the_core_without_the_app_says_what_to_do(monkeypatch):
    monkeypatch.setattr(tables, "_tables", {})
    with pytest.raises(ImproperlyConfigured, match="INSTALLED_APPS"):
        tables.key_model()


def test_the_key_table_s_columns_fit_what_the_core_writes():
    assert IdempotencyKey._meta.get_field("scope").max_length == SCOPE_LENGTH
    assert IdempotencyKey._meta.get_field("route").max_length == ROUTE_LENGTH


@pytest.mark.django_db(transaction=True)
def test_an_engine_handed_a_model_works_on_it_and_looks_for_none(monkeypatch):
    monkeypatch.setattr(tables, "_tables", {})  # nothing to find: the model handed in is used
    engine = Engine(model=IdempotencyKey)

    assert engine.run(Greeting("ada")) == Answer(Outcome.STORED, "hello ada", 1)
    assert IdempotencyKey.objects.get().route == "greeting"
