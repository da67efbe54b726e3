"""End-to-end tests of the async views: ``POST /async/payments/``, ``POST /async/charges/`` and
``POST /ninja/async-payments/``."""

from __future__ import annotations

import base64
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from django_idempotency.models import IdempotencyKey
from payments import provider
from payments.models import LedgerEntry, Payment, ProviderCharge

PAYMENT = {"amount": 1000, "currency": "EUR", "description": "a book"}


@pytest.fixture(autouse=True)
def fast_provider(settings, monkeypatch):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    monkeypatch.setattr(provider, "LATENCY", 0.0)


def client_of(username):
    User.objects.create_user(username, password="password")
    token = base64.b64encode(f"{username}:password".encode()).decode()
    return Client(headers={"Authorization": f"Basic {token}"})


def post(client, path, data, key):
    return client.post(
        path, data, content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/async/payments/", "/ninja/async-payments/"])
def test_an_async_payment_is_taken_once_and_replayed(path):
    alice = client_of("alice")
    first = post(alice, path, PAYMENT, "async-1")
    second = post(alice, path, PAYMENT, "async-1")

    assert (first.status_code, second.status_code) == (201, 201), first.content
    assert (first["Idempotency-Status"], second["Idempotency-Status"]) == ("stored", "replayed")
    assert second.content == first.content
    assert first.json()["id"] == Payment.objects.get().pk
    assert LedgerEntry.objects.get().amount == 1000
    # A WSGI server takes headers of type str alone: runserver's refuses a subclass of it.
    assert [type(value) for value in first.headers.values()] == [str] * len(first.headers)


@pytest.mark.django_db
def test_an_invalid_async_payment_keeps_nothing_and_the_corrected_retry_runs():
    alice = client_of("alice")
    invalid = post(alice, "/async/payments/", {**PAYMENT, "amount": 0}, "async-fix")
    corrected = post(alice, "/async/payments/", PAYMENT, "async-fix")

    assert invalid.status_code == 400
    assert "amount" in invalid.json()
    assert corrected.status_code == 201
    assert corrected["Idempotency-Status"] == "stored"
    assert Payment.objects.count() == 1


@pytest.mark.django_db
def test_an_async_payment_needs_a_user_and_a_post():
    client_of("alice")
    anonymous = post(Client(), "/async/payments/", PAYMENT, "async-anonymous")
    wrong = client_of("bob").get("/async/payments/")

    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"].startswith("Basic")
    assert wrong.status_code == 405
    assert not IdempotencyKey.objects.exists()


class Died(BaseException):
    """A worker that dies after the provider charged: nothing of the request runs after it."""


@pytest.mark.django_db(transaction=True, databases="__all__")  # the provider's, on SQLite
def test_an_async_charge_is_taken_once_and_a_dead_one_is_recovered(monkeypatch):
    alice = client_of("alice")
    charged = post(alice, "/async/charges/", PAYMENT, "charge-1")
    again = post(alice, "/async/charges/", PAYMENT, "charge-1")

    assert (charged.status_code, again.status_code) == (201, 201), charged.content
    assert (charged["Idempotency-Status"], again["Idempotency-Status"]) == ("stored", "replayed")
    assert again.content == charged.content

    # The next charge's worker dies once the provider took the money.
    take = provider.acharge

    async def charge_and_die(*args, **kwargs):
        await take(*args, **kwargs)
        raise Died

    monkeypatch.setattr(provider, "acharge", charge_and_die)
    with pytest.raises(Died):
        post(alice, "/async/charges/", PAYMENT, "charge-2")

    async def never(*args, **kwargs):
        pytest.fail("the retry charged the card again")

    monkeypatch.setattr(provider, "acharge", never)
    # Its lease runs out; the retry asks the provider, which took the money, and charges nothing.
    IdempotencyKey.objects.filter(key="charge-2").update(
        locked_until=timezone.now() - timedelta(seconds=1)
    )
    recovered = post(alice, "/async/charges/", PAYMENT, "charge-2")

    assert recovered.status_code == 201, recovered.content
    assert recovered.json()["provider_reference"] == ProviderCharge.objects.latest("pk").reference
    assert ProviderCharge.objects.count() == Payment.objects.count() == 2
    assert LedgerEntry.objects.count() == 2
    assert IdempotencyKey.objects.count() == 2
