"""@idempotent on async views: the same answers, the view's writes in the key's transaction, and one
database connection per request under an ASGI server, as the bare view's."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.db import connections
from django.db.backends.signals import connection_created
from django.test import AsyncClient

from django_idempotency.core.store import replay_counts
from django_idempotency.models import IdempotencyKey
from tests.testapp.models import LedgerEntry, Payment

pytestmark = pytest.mark.django_db(transaction=True)


async def post(data, key=None, **headers):
    if key is not None:
        headers["Idempotency-Key"] = key
    # Each request gets the thread of its own, as under an ASGI server.
    async with ThreadSensitiveContext():
        try:
            return await AsyncClient().post(
                "/async/", json.dumps(data), content_type="application/json", headers=headers
            )
        finally:
            # That thread's database connection, closed as the end of a request would.
            await sync_to_async(connections.close_all)()


def test_a_retry_is_replayed_and_the_view_runs_once():
    async def scenario():
        return await post({"amount": 7}, "k1"), await post({"amount": 7}, "k1")

    first, retry = asyncio.run(scenario())
    assert (first.status_code, first["Idempotency-Status"]) == (201, "stored")
    assert (retry.status_code, retry["Idempotency-Status"]) == (201, "replayed")
    assert retry.content == first.content
    assert Payment.objects.count() == LedgerEntry.objects.count() == 1


def test_a_changed_retry_and_a_missing_key_are_refused():
    async def scenario():
        await post({"amount": 7}, "k1")
        return await post({"amount": 8}, "k1"), await post({"amount": 7})

    changed, missing = asyncio.run(scenario())
    assert json.loads(changed.content)["code"] == "idempotency.payload_mismatch"
    assert json.loads(missing.content)["code"] == "idempotency.key_missing"
    assert Payment.objects.count() == 1


@pytest.mark.parametrize("failure", [{"X-Fail": "exception"}, {"X-Status": "503"}])
def test_a_failing_async_view_leaves_nothing_and_its_retry_runs_again(failure):
    async def scenario():
        try:
            failed = await post({"amount": 7}, "k1", **failure)
        except RuntimeError:
            failed = None  # the test client raises the view's exception
        return failed, await post({"amount": 7}, "k1")

    failed, retry = asyncio.run(scenario())
    assert failed is None or failed.status_code == 503
    assert (retry.status_code, retry["Idempotency-Status"]) == (201, "stored")
    # The failed attempt's payment and ledger entry were rolled back with its key.
    assert Payment.objects.count() == LedgerEntry.objects.count() == 1
    assert IdempotencyKey.objects.count() == 1


@pytest.mark.server_db
def test_concurrent_async_duplicates_have_one_effect_and_the_same_answer():
    async def scenario():
        return await asyncio.gather(
            *(post({"amount": 7}, "same", **{"X-Hold": "0.2"}) for _ in range(8))
        )

    answers = asyncio.run(scenario())
    assert {(a.status_code, a.content) for a in answers} == {(201, answers[0].content)}
    assert sorted(a["Idempotency-Status"] for a in answers) == ["replayed"] * 7 + ["stored"]
    assert Payment.objects.count() == LedgerEntry.objects.count() == 1


async def served(handler, path, key=None):
    """POST a payment to ``path`` through Django's ASGI handler, as an ASGI server calls it:
    each request in a thread of its own, its connection closed at its end (CONN_MAX_AGE = 0)."""
    body = json.dumps({"amount": 7}).encode()
    headers = [
        (b"host", b"testserver"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if key is not None:
        headers.append((b"idempotency-key", key.encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": headers, "server": ("testserver", 80),
        "client": ("127.0.0.1", 50000),
    }  # fmt: skip
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    answered = asyncio.Event()
    sent = []

    async def receive():
        if messages:
            return messages.pop()
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    await handler(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {name.lower(): value for name, value in start["headers"]}
    return start["status"], headers.get(b"idempotency-status")


@contextlib.contextmanager
def connections_opened():
    """The database connections opened meanwhile."""
    opened = []

    def count(sender, connection, **kwargs):
        opened.append(connection)

    connection_created.connect(count)
    try:
        yield opened
    finally:
        connection_created.disconnect(count)


@pytest.mark.server_db
def test_an_async_keyed_view_opens_one_connection_per_request_as_its_bare_twin(monkeypatch):
    # The replay counts wait in memory meanwhile: what they write, once a second for the whole
    # process, is not a request's.
    monkeypatch.setattr(replay_counts, "delay", 3600)
    handler = ASGIHandler()

    async def scenario():
        answers, opened = [], []
        # Each view reads the database first, as authentication would.
        for path, key in [
            ("/async/read-first/bare/", None),  # the bare twin
            ("/async/read-first/", "k1"),  # fresh
            ("/async/read-first/", "k1"),  # replay
            ("/async/read-first/", "k2"),  # fresh again, on a thread of its own
        ]:
            with connections_opened() as connected:
                answers.append(await served(handler, path, key))
            opened.append(connected)
        return answers, opened

    answers, opened = asyncio.run(scenario())
    assert answers == [(201, None), (201, b"stored"), (201, b"replayed"), (201, b"stored")]
    # One connection each, the bare twin's count: the engine's statements, the view's (in the
    # key's transaction) and the replay's read share the request's connection and thread.
    assert [len(connected) for connected in opened] == [1, 1, 1, 1]
    # ... and closed with the request: none is left open in a thread that is gone.
    assert all(wrapper.connection is None for connected in opened for wrapper in connected)
    assert Payment.objects.count() == LedgerEntry.objects.count() == 3
    assert IdempotencyKey.objects.count() == 2
