"""Faults from the edges, black-box: what arrives on the wire, a frozen cache, a lost database.

Each test serves the example project, sends what a real client, proxy or provider can send, and
counts the effects in the database afterwards. Where the exact problem code is a detail of the
fix, the tests ask for a 4xx ``application/problem+json``; on effects they are exact.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from django_idempotency.signing import StandardWebhooksSignature, StripeSignature
from tests.blackbox.harness import (
    PAYMENT_EVENTS_SECRET,
    PROBLEM,
    PROVIDER_SECRET,
    environment,
    manage,
    wait_for,
)

pytestmark = pytest.mark.postgresql

PAYMENTS = "/api/payments/"
PAYMENT = {"amount": 1000, "currency": "eur", "description": "a book"}
PAYMENT_BODY = json.dumps(PAYMENT).encode()
PROVIDER_WEBHOOK = "/webhooks/provider/"
PAYMENT_EVENTS_WEBHOOK = "/webhooks/payments/"
# About 10 KB of [[[[…]]]]: deeper than Python's recursion limit.
DEEP_JSON = b"[" * 5_000 + b"]" * 5_000


def signed_by_provider(body: bytes) -> list[tuple[str, str]]:
    return list(StripeSignature([PROVIDER_SECRET]).sign(body).items())


def problem(answer) -> tuple[bool, str]:
    """Whether ``answer`` is a 4xx problem, and its code; for a readable assertion."""
    return (
        400 <= answer.status < 500 and answer.content_type == PROBLEM,
        answer.field("code") or str(answer),
    )


def test_an_idempotency_key_header_sent_twice_is_refused_not_joined(serve, database):
    # A server joins repeated header lines with a comma: "k" twice arrives as "k,k", which a
    # retry with one header line would never match.
    server = serve()
    twice = server.send("POST", PAYMENTS, PAYMENT_BODY, headers=[("Idempotency-Key", "k-1")] * 2)
    two_keys = server.send(
        "POST",
        PAYMENTS,
        PAYMENT_BODY,
        headers=[("Idempotency-Key", "k-1"), ("Idempotency-Key", "k-2")],
    )
    refused = database.effects()
    retry = server.send("POST", PAYMENTS, PAYMENT_BODY, key="k-1")

    invalid = (400, PROBLEM, "idempotency.key_invalid")
    assert {
        "k twice": (twice.status, twice.content_type, twice.field("code")),
        "k-1 and k-2": (two_keys.status, two_keys.content_type, two_keys.field("code")),
    } == {"k twice": invalid, "k-1 and k-2": invalid}, f"{twice} / {two_keys}"
    assert (refused["payments"], refused["stored keys"]) == (0, 0), refused
    assert retry.status == 201, str(retry)
    effects = database.effects()
    assert (effects["payments"], effects["stored keys"]) == (1, 1), effects


def test_deeply_nested_json_is_a_400_problem_never_a_500(serve, database):
    server = serve()
    created = server.send("POST", PAYMENTS, PAYMENT_BODY, key="deep-setup")
    assert created.status == 201, str(created)
    payment = created.field("id")
    before = database.effects()

    keyed = server.send("POST", PAYMENTS, DEEP_JSON, key="deep-1")
    webhook = server.send(
        "POST", PROVIDER_WEBHOOK, DEEP_JSON, headers=signed_by_provider(DEEP_JSON), auth=False
    )
    # No key: DRF's own parser reads it, in a view where a key is optional.
    keyless = server.send("PATCH", f"{PAYMENTS}{payment}/", DEEP_JSON)

    assert {
        "keyed POST": problem(keyed)[0],
        "signed webhook": problem(webhook)[0],
        "PATCH without a key": keyless.status == 400,
    } == {"keyed POST": True, "signed webhook": True, "PATCH without a key": True}, (
        f"keyed POST: {keyed}; signed webhook: {webhook}; PATCH without a key: {keyless}"
    )
    assert database.effects() == before
    assert database.execute("SELECT version FROM payments_payment") == [(1,)]


def test_a_chunked_keyed_body_is_refused_before_the_key_is_claimed(serve, database):
    # Without Content-Length a WSGI application reads no body: the key would be spent on a
    # request the view saw empty.
    server = serve()
    chunked = server.send("POST", PAYMENTS, PAYMENT_BODY, key="chunked-1", chunked=True)
    refused = database.effects()
    whole = server.send("POST", PAYMENTS, PAYMENT_BODY, key="chunked-1")
    event = {"id": "evt_chunked", "type": "refund.pending", "data": {"refund": 1, "sequence": 1}}
    body = json.dumps(event).encode()
    webhook = server.send(
        "POST", PROVIDER_WEBHOOK, body, headers=signed_by_provider(body), auth=False, chunked=True
    )

    effects = database.effects()

    assert {
        "chunked POST: a 400/411 problem": (chunked.status in {400, 411}, chunked.content_type),
        "chunked POST: payments, keys": (refused["payments"], refused["stored keys"]),
        "the same POST with Content-Length": whole.status,
        "chunked webhook: a 400/411 problem": (webhook.status in {400, 411}, webhook.content_type),
        "chunked webhook: refused as badly signed": webhook.field("code")
        == "inbox.signature_invalid",
        "at the end: payments, keys, inbox events": (
            effects["payments"],
            effects["stored keys"],
            effects["inbox events"],
        ),
    } == {
        "chunked POST: a 400/411 problem": (True, PROBLEM),
        "chunked POST: payments, keys": (0, 0),
        "the same POST with Content-Length": 201,
        "chunked webhook: a 400/411 problem": (True, PROBLEM),
        "chunked webhook: refused as badly signed": False,
        "at the end: payments, keys, inbox events": (1, 1, 0),
    }, f"chunked POST: {chunked}; the same with Content-Length: {whole}; chunked webhook: {webhook}"


def test_a_frozen_cache_holds_no_request_and_duplicates_nothing(serve, redis_server, database):
    # The replay cache on a Redis that stops answering (SIGSTOP; a black-holed failover
    # address does the same): every request must still answer, in time, from the database.
    bound = 5.0
    server = serve(REDIS_URL=redis_server.url)
    warm = server.send("POST", PAYMENTS, PAYMENT_BODY, key="cached")
    assert warm.status == 201, str(warm)
    keys = ["cached"] + [f"burst-{n}" for n in range(6)]

    def send(key):
        try:
            return server.send("POST", PAYMENTS, PAYMENT_BODY, key=key, timeout=bound)
        except OSError:  # a timeout, most likely: no answer
            return None

    redis_server.freeze()
    try:
        with ThreadPoolExecutor(len(keys) * 2) as pool:
            frozen = list(zip(keys * 2, pool.map(send, keys * 2), strict=True))
    finally:
        redis_server.thaw()
    # Once the cache answers again every key replays, whatever became of the requests above.
    after = {key: server.send("POST", PAYMENTS, PAYMENT_BODY, key=key) for key in keys}

    assert {key: answer.status for key, answer in after.items()} == dict.fromkeys(keys, 201)
    effects = database.effects()
    assert (effects["payments"], effects["ledger entries"], effects["stored keys"]) == (7, 7, 7)
    assert {after[key].field("id") for key in keys} == database.payment_ids()
    late = [(key, answer and round(answer.seconds, 1)) for key, answer in frozen]
    assert all(answer is not None and answer.status == 201 for _, answer in frozen), (
        f"requests that did not answer 201 within {bound} s while the cache was frozen "
        f"(key, seconds; None: no answer): {late}"
    )


def test_a_recorded_webhook_whose_processing_loses_the_database_answers_2xx(serve, database):
    # Once the event is recorded, processing it is the inbox's job: a 5xx would only make the
    # provider deliver it again, and disable the endpoint after enough of them.
    server = serve(EXAMPLE_INBOX_HANDLER_DELAY="2")
    payment = server.send("POST", PAYMENTS, PAYMENT_BODY, key="lost-db").field("id")
    event = {"id": "evt_lost_db", "type": "payment.captured", "data": {"payment": payment}}
    body = json.dumps(event).encode()
    headers = StandardWebhooksSignature([PAYMENT_EVENTS_SECRET]).sign(body, msg_id="msg_lost_db")

    with ThreadPoolExecutor(1) as pool:
        delivery = pool.submit(
            server.send, "POST", PAYMENT_EVENTS_WEBHOOK, body, headers=list(headers.items()),
            auth=False,
        )  # fmt: skip
        wait_for(
            lambda: database.count("django_idempotency_inboxevent", "status = 'processing'"),
            timeout=10,
            what="the handler to run",
        )
        # The handler is in its delay, in the transaction that records its outcome.
        time.sleep(0.5)
        terminated = database.terminate_other_connections()
        answer = delivery.result(timeout=30)
    recorded = database.effects()

    # The inbox retries the event when it is due; make it due now rather than wait.
    database.execute(
        "UPDATE django_idempotency_inboxevent SET next_attempt_at = now() "
        "WHERE status <> 'processed'"
    )
    manage(environment(database), "idempotency_inbox", "--no-purge")

    assert terminated >= 1
    processed = database.execute("SELECT status FROM django_idempotency_inboxevent")
    assert {
        "the delivery answered 2xx": 200 <= answer.status < 300,
        "inbox events recorded": recorded["inbox events"],
        "after the inbox's run: statuses, receipts": (
            processed,
            database.count("payments_receiptemail"),
        ),
    } == {
        "the delivery answered 2xx": True,
        "inbox events recorded": 1,
        "after the inbox's run: statuses, receipts": ([("processed",)], 1),
    }, f"the delivery's answer: {answer}"


def test_a_body_the_framework_refused_before_the_view_ran_is_not_kept(serve, database):
    # Stripe keeps no answer to a request it refused as invalid: the corrected retry, with the
    # same key, must run, and junk sent with many keys must leave no rows behind.
    server = serve()
    refused = {
        media_type: server.send(
            "POST", PAYMENTS, PAYMENT_BODY, key=f"media-{n}", headers=[("Content-Type", media_type)]
        )
        for n, media_type in enumerate(["text/plain", "application/merge-patch+json"])
    }
    junk = [
        server.send(
            "POST", PAYMENTS, b"{", key=f"junk-{n}", headers=[("Content-Type", "text/plain")]
        )
        for n in range(20)
    ]
    left = database.effects()
    corrected = [server.send("POST", PAYMENTS, PAYMENT_BODY, key=f"media-{n}") for n in range(2)]

    assert {name: answer.status for name, answer in refused.items()} == dict.fromkeys(refused, 415)
    assert {answer.status for answer in junk} == {415}
    assert (left["payments"], left["stored keys"]) == (0, 0), left
    assert [answer.status for answer in corrected] == [201, 201], [str(a) for a in corrected]
    assert [answer.headers["Idempotency-Status"] for answer in corrected] == ["stored"] * 2


def test_nan_infinity_and_unstorable_text_are_4xx_and_the_corrected_retry_runs(serve, database):
    server = serve()
    not_json = {
        constant: f'{{"amount": 1000, "currency": "eur", "metadata": {{"r": {constant}}}}}'
        for constant in ("NaN", "Infinity", "-Infinity")
    }
    # JSON, but text that PostgreSQL stores neither in a text column nor in jsonb.
    unstorable = {
        "nul-in-description": '{"amount": 1000, "currency": "eur", "description": "a\\u0000"}',
        "nul-in-metadata": '{"amount": 1000, "currency": "eur", "metadata": {"n": "\\u0000"}}',
        "lone-surrogate": '{"amount": 1000, "currency": "eur", "description": "a\\ud800b"}',
        "surrogate-in-metadata": '{"amount": 1, "currency": "eur", "metadata": {"\\udfff": 1}}',
    }
    answers = {
        name: server.send("POST", PAYMENTS, body.encode(), key=name)
        for name, body in {**not_json, **unstorable}.items()
    }
    refused = database.effects()
    retries = {name: server.send("POST", PAYMENTS, PAYMENT_BODY, key=name) for name in answers}

    assert {name: problem(answers[name]) for name in not_json} == dict.fromkeys(
        not_json, (True, "idempotency.body_invalid")
    )
    assert {name: answers[name].status for name in unstorable} == dict.fromkeys(unstorable, 400), {
        name: str(answers[name]) for name in unstorable
    }
    assert (refused["payments"], refused["stored keys"]) == (0, 0), refused
    assert {name: retry.status for name, retry in retries.items()} == dict.fromkeys(answers, 201)


def test_the_served_project_runs_on_the_driver_of_the_pass(database):
    # runtests.py serves the fault tests with psycopg 3, and with psycopg2 in its psycopg2 pass.
    driver = manage(
        environment(database),
        "shell",
        "--verbosity",
        "0",
        "-c",
        "from django.db import connection; print(connection.Database.__name__)",
    )
    assert driver.strip() == os.environ.get("TEST_PG_DRIVER", "psycopg")
