"""The replay cache on a real Redis: an accelerator that is never the arbiter."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import caches
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.engine import default_engine
from django_idempotency.models import IdempotencyKey
from tests.conftest import ApiClient
from tests.testapp.models import LedgerEntry, Payment

REDIS = {"BACKEND": "django.core.cache.backends.redis.RedisCache"}
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "replay": {**REDIS, "LOCATION": "redis://127.0.0.1:6379/15"},
    "down": {**REDIS, "LOCATION": "redis://127.0.0.1:1/0"},
}

pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def replay_cache():
    with override_settings(CACHES=CACHES, IDEMPOTENCY={"CACHE": "replay"}):
        caches["replay"].clear()
        yield caches["replay"]
        caches["replay"].clear()


def key_table_queries(captured) -> list[str]:
    return [q["sql"] for q in captured if IdempotencyKey._meta.db_table in q["sql"]]


def test_a_replay_is_served_from_the_cache_without_the_database(client_alice, key):
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    with CaptureQueriesContext(connection) as captured:
        second = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert second["Idempotency-Status"] == "replayed"
    assert second.content == first.content
    assert second["Location"] == first["Location"]
    assert key_table_queries(captured) == []
    assert Payment.objects.count() == 1


def test_a_flushed_cache_falls_back_to_the_database_and_refills(client_alice, key, replay_cache):
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    replay_cache.clear()
    second = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    with CaptureQueriesContext(connection) as captured:
        third = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert second.content == third.content == first.content
    assert second["Idempotency-Status"] == third["Idempotency-Status"] == "replayed"
    assert key_table_queries(captured) == []  # refilled by the database replay
    assert IdempotencyKey.objects.get().replay_count == 1  # only the database replay counted


@override_settings(IDEMPOTENCY={"CACHE": "down"})
def test_a_cache_that_is_down_costs_speed_never_an_error(client_alice, key, caplog):
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    second = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert "replay cache unavailable" in caplog.text
    assert Payment.objects.count() == 1


def test_a_different_request_is_judged_by_the_database(client_alice, key):
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert client_alice.send("POST", "/payments/", {"amount": 6}, key=key).status_code == 422


def test_an_expired_key_is_not_served_from_the_cache(client_alice, key, monkeypatch):
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    later = timezone.now() + timedelta(hours=25)
    monkeypatch.setattr(default_engine, "clock", lambda: later)
    again = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert again["Idempotency-Status"] == "stored"
    assert Payment.objects.count() == 2


def test_a_response_that_is_rolled_back_is_never_cached(client_alice, key, replay_cache):
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key, headers={"X-Status": "503"})
    retry = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert retry["Idempotency-Status"] == "stored"
    assert (Payment.objects.count(), LedgerEntry.objects.count()) == (1, 1)


@pytest.mark.postgresql
def test_concurrent_duplicates_with_a_cache_flushed_meanwhile_make_one_payment(
    alice, key, replay_cache
):
    from tests.test_store import in_threads  # noqa: PLC0415

    def post(index):
        if index == 10:
            replay_cache.clear()
        return ApiClient(alice).send(
            "POST", "/payments/", {"amount": 9}, key=key, headers={"X-Hold": "0.2"}
        )

    responses = in_threads(20, post)
    assert Payment.objects.count() == 1
    assert all(response.status_code in (201, 409) for response in responses)
    assert len({r.content for r in responses if r.status_code == 201}) == 1
