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
