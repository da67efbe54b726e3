"""End-to-end tests of the example project: real URLs, views and database."""

from __future__ import annotations

import base64
import re
import socket
import uuid

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.test import Client

from django_idempotency.models import IdempotencyKey
from example_project.settings import database_from_url
from payments import provider
from payments.management.stories import STORIES
from payments.management.storytelling import TABLES
from payments.models import CustomerNotice, LedgerEntry, Payment, Refund


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    # Every request authenticates with HTTP Basic: a slow hash per request adds up.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def alice(db):
    User.objects.create_user("alice", password="password")
    token = base64.b64encode(b"alice:password").decode()
    return Client(headers={"Authorization": f"Basic {token}"})


def post(client, path, data, key):
    return client.post(
        path, data, content_type="application/json", headers={"Idempotency-Key": key}
    )


@pytest.mark.django_db(transaction=True, databases="__all__")  # the provider's, on SQLite
def test_demo_runs_and_every_story_passes(capsys):
    call_command("demo")

    out = capsys.readouterr().out
    assert f"All {len(STORIES)} stories behaved as promised." in out
    assert "h. crash mid-charge" in out
    assert "✘" not in out
    # Story e's kept 400 says why, where the README says a 400 is not kept.
    assert "invalid_request_status_codes" in out
    # Each story's database column counts what it created: together, what the admin then lists.
    for model, one, many in TABLES:
        said = sum(int(n) for n in re.findall(rf"\+(\d+) (?:{many}|{one})\b", out))
        assert said == model._default_manager.count(), many
    # The answers were made for the host the demo serves on, and are replayed with its links.
    bodies = b"".join(
        IdempotencyKey.objects.exclude(response_body=None).values_list("response_body", flat=True)
    )
    assert b"http://127.0.0.1:8000/api/payments/" in bodies
    assert b"testserver" not in bodies


@pytest.mark.django_db(transaction=True, databases="__all__")
def test_demo_says_the_port_is_taken_before_playing_a_story():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=rf"127\.0\.0\.1:{port}: .* --port"):
            call_command("demo", "--port", str(port))
    assert not Payment.objects.exists()


def test_payment_replay_is_byte_identical(alice):
    key = str(uuid.uuid4())
    data = {"amount": 1000, "currency": "EUR", "description": "book"}

    first = post(alice, "/api/payments/", data, key)
    second = post(alice, "/api/payments/", data, key)

    assert first.status_code == second.status_code == 201
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert second["Idempotent-Replayed"] == "true"
    assert second.content == first.content
    assert second["Location"] == first["Location"] == first.json()["url"]
    assert Payment.objects.get().currency == "eur"
    assert LedgerEntry.objects.get().amount == 1000


def test_over_refund_400_is_stored_and_replayed(alice):
    payment = post(alice, "/api/payments/", {"amount": 3000, "currency": "eur"}, "pay-1").json()
    key = str(uuid.uuid4())
    refund = {"payment": payment["id"], "amount": 5000}

    first = post(alice, "/api/refunds/", refund, key)
    second = post(alice, "/api/refunds/", refund, key)

    assert first.status_code == second.status_code == 400
    assert "amount" in first.json()
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert second.content == first.content
    assert not Refund.objects.exists()
    assert Payment.objects.get().amount_refunded == 0


@pytest.mark.django_db(transaction=True)
def test_a_provider_webhook_delivered_twice_tells_the_customer_once(alice):
    payment = post(alice, "/api/payments/", {"amount": 900, "currency": "eur"}, str(uuid.uuid4()))
    refund = post(alice, "/api/refunds/", {"payment": payment.json()["id"], "amount": 300}, "r1")
    _pending, succeeded = provider.refund_events(refund.json()["id"])

    answers = []
    for _ in range(2):
        body, headers = provider.signed(succeeded)
        answers.append(
            Client()
            .post("/webhooks/provider/", body, content_type="application/json", headers=headers)
            .json()
        )

    assert answers == [{"status": "processed"}, {"status": "duplicate"}]
    assert Refund.objects.get().provider_status == "succeeded"
    assert [notice.message for notice in CustomerNotice.objects.all()] == [
        "Your refund of 300 eur is on its way."
    ]


def test_the_schema_documents_keys_and_preconditions(alice):
    schema = alice.get("/api/schema/", headers={"Accept": "application/vnd.oai.openapi+json"})
    assert schema.status_code == 200
    paths = schema.json()["paths"]

    def headers(path, method):
        parameters = paths[path][method].get("parameters", [])
        return {p["name"]: p["required"] for p in parameters if p["in"] == "header"}

    assert headers("/api/payments/", "post") == {"Idempotency-Key": True}
    assert headers("/api/payments/{id}/", "patch") == {"Idempotency-Key": False, "If-Match": False}
    assert "412" in paths["/api/payments/{id}/"]["patch"]["responses"]
    assert "Idempotency-Key" not in headers("/api/payments/", "get")


def test_the_metrics_count_decisions(alice):
    post(alice, "/api/payments/", {"amount": 100, "currency": "EUR"}, "metrics-key")
    post(alice, "/api/payments/", {"amount": 100, "currency": "EUR"}, "metrics-key")
    assert Client().get("/metrics/").status_code == 403  # not for everyone
    staff = Client()
    staff.force_login(User.objects.create_user("ops", is_staff=True))
    scraped = staff.get("/metrics/").content.decode()
    assert 'django_idempotency_requests_total{outcome="replayed",route="api/payments/"}' in scraped
    assert "django_idempotency_inbox_dead_events 0.0" in scraped


@pytest.mark.django_db
def test_a_scraper_reads_the_metrics_with_the_token(settings):
    settings.METRICS_TOKEN = "scrape-me"
    scraper = Client()
    assert scraper.get("/metrics/", headers={"Authorization": "Bearer wrong"}).status_code == 403
    scraped = scraper.get("/metrics/", headers={"Authorization": "Bearer scrape-me"})
    assert scraped.status_code == 200
    assert b"django_idempotency_requests_total" in scraped.content


def test_metadata_must_be_an_object_even_from_a_form(alice):
    response = alice.post(
        "/api/payments/",
        {"amount": "100", "currency": "EUR", "metadata": "null"},
        headers={"Idempotency-Key": "form-null"},
    )
    assert response.status_code == 400
    assert "metadata" in response.json()
    assert not Payment.objects.exists()


@pytest.mark.parametrize(
    ("metadata", "refused"),
    [
        ({"a": {"b": [[[[[[1]]]]]]}}, None),  # 8 levels
        ({"a": {"b": [[[[[[[1]]]]]]]}}, "Must be nested at most 8 levels deep."),
        ({"note": "x" * 8000}, None),
        ({"note": "x" * 8200}, "Must be at most 8192 characters of JSON."),
        ({"n\x00": 1}, "Must not hold NUL characters."),
    ],
)
@pytest.mark.parametrize("path", ["/api/payments/", "/ninja/payments/"])
def test_metadata_is_capped_in_depth_and_size(alice, path, metadata, refused):
    data = {"amount": 100, "currency": "EUR", "metadata": metadata}
    response = post(alice, path, data, f"metadata-{uuid.uuid4()}")

    if refused is None:
        assert response.status_code == 201
        assert Payment.objects.get().metadata == metadata
    else:
        assert response.status_code == (400 if path.startswith("/api/") else 422)
        assert refused in response.content.decode()
        assert not Payment.objects.exists()


@pytest.mark.parametrize("key", [None, "deep-json"])
def test_deeply_nested_json_is_a_400_with_or_without_a_key(alice, key):
    created = post(alice, "/api/payments/", {"amount": 100, "currency": "EUR"}, "deep-create")
    deep = b'{"metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    headers = {"Idempotency-Key": key} if key else {}

    response = alice.patch(
        created["Location"], deep, content_type="application/json", headers=headers
    )

    assert response.status_code == 400
    assert Payment.objects.get().version == 1


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_database_url_postgres(scheme):
    assert database_from_url(f"{scheme}://bob:p%40ss@db.example:5433/shop") == {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "shop",
        "USER": "bob",
        "PASSWORD": "p@ss",
        "HOST": "db.example",
        "PORT": "5433",
    }


def test_database_url_mysql_speaks_utf8mb4():
    assert database_from_url("mysql://root@127.0.0.1:3306/shop") == {
        "ENGINE": "django.db.backends.mysql",
        "NAME": "shop",
        "USER": "root",
        "PASSWORD": "",
        "HOST": "127.0.0.1",
        "PORT": "3306",
        "OPTIONS": {"charset": "utf8mb4"},
    }


def test_database_url_names_the_schemes_it_accepts():
    with pytest.raises(ImproperlyConfigured, match=r"postgres:// or mysql:// URL, not 'sqlite'"):
        database_from_url("sqlite:///db.sqlite3")
