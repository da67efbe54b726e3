"""@idempotent on async views: the same answers, and the view's writes in the key's transaction."""

from __future__ import annotations

import asyncio
import json

import pytest
from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.db import connections
from django.test import AsyncClient

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
