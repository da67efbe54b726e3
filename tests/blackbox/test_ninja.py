"""The Django Ninja route of the example project, black-box: ``POST /ninja/payments/``.

The same contract as the DRF route, over HTTP to gunicorn workers: duplicates sent at once make
one payment, a chunked or doubled key is refused before it is claimed, and Ninja's own refusal
of invalid input keeps nothing, so the corrected retry runs.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.blackbox.harness import PROBLEM

pytestmark = pytest.mark.postgresql

NINJA_PAYMENTS = "/ninja/payments/"
PAYMENT = {"amount": 1000, "currency": "eur", "description": "a book"}
PAYMENT_BODY = json.dumps(PAYMENT).encode()


def test_duplicates_sent_at_once_make_one_payment_and_get_one_answer(serve, database):
    server = serve()
    count = 8

    def send(_):
        return server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY, key="ninja-burst")

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(send, range(count)))

    effects = database.effects()
    assert sorted(answer.status for answer in answers) == [201] * count, [str(a) for a in answers]
    assert sorted(answer.headers["Idempotency-Status"] for answer in answers) == (
        ["replayed"] * (count - 1) + ["stored"]
    )
    assert len({answer.body for answer in answers}) == 1
    assert (effects["payments"], effects["ledger entries"], effects["stored keys"]) == (1, 1, 1)
    assert {answers[0].field("id")} == database.payment_ids()


def test_invalid_input_keeps_nothing_and_the_corrected_retry_runs(serve, database):
    server = serve()
    invalid = server.post_json(NINJA_PAYMENTS, {**PAYMENT, "amount": 0}, key="ninja-fix")
    refused = database.effects()
    corrected = server.post_json(NINJA_PAYMENTS, PAYMENT, key="ninja-fix")
    changed = server.post_json(NINJA_PAYMENTS, {**PAYMENT, "amount": 5}, key="ninja-fix")

    assert invalid.status == 422, str(invalid)
    assert (refused["payments"], refused["stored keys"]) == (0, 0), refused
    assert corrected.status == 201, str(corrected)
    assert (changed.status, changed.content_type, changed.field("code")) == (
        422,
        PROBLEM,
        "idempotency.payload_mismatch",
    ), str(changed)
    effects = database.effects()
    assert (effects["payments"], effects["stored keys"]) == (1, 1), effects


def test_a_doubled_or_missing_key_and_a_chunked_body_are_refused_unclaimed(serve, database):
    server = serve()
    twice = server.send(
        "POST", NINJA_PAYMENTS, PAYMENT_BODY, headers=[("Idempotency-Key", "ninja-k")] * 2
    )
    missing = server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY)
    chunked = server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY, key="ninja-k", chunked=True)
    anonymous = server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY, key="ninja-k", auth=False)
    refused = database.effects()
    whole = server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY, key="ninja-k")

    assert {
        "key twice": (twice.status, twice.content_type, twice.field("code")),
        "no key": (missing.status, missing.content_type, missing.field("code")),
        # Ninja validates the body it read as empty (a 422) before the key is looked at.
        "chunked: a 4xx": 400 <= chunked.status < 500,
        # 403: Ninja's session authentication, tried last, asks for a CSRF token.
        "no credentials: refused": anonymous.status in {401, 403},
    } == {
        "key twice": (400, PROBLEM, "idempotency.key_invalid"),
        "no key": (400, PROBLEM, "idempotency.key_missing"),
        "chunked: a 4xx": True,
        "no credentials: refused": True,
    }, f"twice: {twice}; missing: {missing}; chunked: {chunked}; anonymous: {anonymous}"
    assert (refused["payments"], refused["stored keys"]) == (0, 0), refused
    assert whole.status == 201, str(whole)
    effects = database.effects()
    assert (effects["payments"], effects["stored keys"]) == (1, 1), effects


def test_the_schema_documents_the_key_and_its_answers(serve, database):
    answer = serve().send("GET", "/ninja/openapi.json", auth=False)

    operation = answer.json()["paths"][NINJA_PAYMENTS]["post"]
    [header] = [p for p in operation["parameters"] if p["name"] == "Idempotency-Key"]
    assert header["required"] is True
    assert {"400", "409", "422", "503"} <= set(operation["responses"])


# Python's json module reads these; RFC 8259 does not have them, and PostgreSQL's jsonb refuses
# them.
NOT_JSON = {
    "NaN": b'{"amount": 1000, "currency": "eur", "metadata": {"rate": NaN}}',
    "Infinity": b'{"amount": 1000, "currency": "eur", "metadata": {"rate": Infinity}}',
    "-Infinity": b'{"amount": 1000, "currency": "eur", "metadata": {"rate": -Infinity}}',
}
# JSON, but text that PostgreSQL stores neither in a text column nor in jsonb.
UNSTORABLE_TEXT = {
    "nul-in-description": b'{"amount": 1000, "currency": "eur", "description": "a\\u0000b"}',
    "nul-in-metadata": b'{"amount": 1000, "currency": "eur", "metadata": {"n": "a\\u0000b"}}',
    "lone-surrogate": b'{"amount": 1000, "currency": "eur", "description": "a\\ud800b"}',
    "surrogate-in-metadata": b'{"amount": 1, "currency": "eur", "metadata": {"\\udfff": 1}}',
}


def test_nan_and_infinity_are_refused_as_unreadable_and_the_corrected_retry_runs(serve, database):
    server = serve()
    answers = {
        name: server.send("POST", NINJA_PAYMENTS, body, key=f"ninja-{name}")
        for name, body in NOT_JSON.items()
    }
    refused = database.effects()
    retries = {
        name: server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY, key=f"ninja-{name}").status
        for name in NOT_JSON
    }

    assert {
        name: (answer.status, answer.content_type, answer.field("code"))
        for name, answer in answers.items()
    } == dict.fromkeys(NOT_JSON, (400, PROBLEM, "idempotency.body_invalid")), {
        name: str(answer) for name, answer in answers.items()
    }
    assert (refused["payments"], refused["stored keys"]) == (0, 0), refused
    assert retries == dict.fromkeys(NOT_JSON, 201)


def test_text_the_database_cannot_store_is_refused_as_invalid_input(serve, database):
    server = serve()
    answers = {
        name: server.send("POST", NINJA_PAYMENTS, body, key=f"ninja-{name}")
        for name, body in UNSTORABLE_TEXT.items()
    }
    refused = database.effects()
    retries = {
        name: server.send("POST", NINJA_PAYMENTS, PAYMENT_BODY, key=f"ninja-{name}").status
        for name in UNSTORABLE_TEXT
    }

    assert {name: answer.status for name, answer in answers.items()} == dict.fromkeys(
        UNSTORABLE_TEXT, 422
    ), {name: str(answer) for name, answer in answers.items()}
    assert (refused["payments"], refused["stored keys"]) == (0, 0), refused
    assert retries == dict.fromkeys(UNSTORABLE_TEXT, 201)
