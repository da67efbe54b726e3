"""End-to-end tests of the Django Ninja route, ``POST /ninja/payments/``."""

from __future__ import annotations

import base64
import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from django_idempotency.models import IdempotencyKey
from payments.models import LedgerEntry, Payment

PAYMENT = {"amount": 1000, "currency": "EUR", "description": "a book"}


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def client_of(username):
    User.objects.create_user(username, password="password")
    token = base64.b64encode(f"{username}:password".encode()).decode()
    return Client(headers={"Authorization": f"Basic {token}"})


def post(client, data, key):
    return client.post(
        "/ninja/payments/", data, content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.mark.django_db
def test_a_retried_payment_is_taken_once_and_replayed():
    alice = client_of("alice")
    first = post(alice, PAYMENT, "ninja-1")
    second = post(alice, PAYMENT, "ninja-1")

    assert first.status_code == second.status_code == 201
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert second.content == first.content
    payment = Payment.objects.get()
    assert payment.owner.username == "alice"
    assert payment.currency == "eur"
    assert LedgerEntry.objects.count() == 1


@pytest.mark.django_db
def test_invalid_input_keeps_nothing_and_a_changed_payload_is_a_mismatch():
    alice = client_of("alice")
    invalid = post(alice, {**PAYMENT, "amount": 0}, "ninja-2")
    created = post(alice, PAYMENT, "ninja-2")
    changed = post(alice, {**PAYMENT, "amount": 2000}, "ninja-2")

    assert invalid.status_code == 422
    assert created.status_code == 201
    assert changed.status_code == 422
    assert json.loads(changed.content)["code"] == "idempotency.payload_mismatch"
    assert Payment.objects.count() == IdempotencyKey.objects.count() == 1


@pytest.mark.django_db
def test_without_credentials_the_key_is_never_claimed():
    answer = Client().post(
        "/ninja/payments/", PAYMENT, content_type="application/json",
        headers={"Idempotency-Key": "ninja-3"},
    )  # fmt: skip
    assert answer.status_code == 401
    assert IdempotencyKey.objects.count() == 0


@pytest.mark.django_db
def test_the_schema_documents_the_key():
    schema = json.loads(Client().get("/ninja/openapi.json").content)
    operation = schema["paths"]["/ninja/payments/"]["post"]
    assert any(p["name"] == "Idempotency-Key" for p in operation["parameters"])
    assert "application/problem+json" in operation["responses"]["409"]["content"]
