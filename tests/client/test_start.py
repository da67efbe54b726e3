"""The start of a logical request (``client._start``).

Its idempotency key, which methods may be retried, and the correlation id it passes below.
"""

from __future__ import annotations

import uuid

import pytest

from tests.client.helpers import KINDS, answer, call, make_policy, reset


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_request_without_a_key_gets_one_and_every_retry_repeats_it(kind, method, server, fake):
    server.script.extend([answer(503), reset, answer(429)])

    result = call(kind, make_policy(fake), method, server.url(), content=b'{"amount": 5}')

    assert result.status == 200
    assert [seen.method for seen in server.seen] == [method] * 4
    keys = {seen.headers["idempotency-key"] for seen in server.seen}
    assert len(keys) == 1
    assert uuid.UUID(keys.pop()).version == 4
    assert {seen.body for seen in server.seen} == {b'{"amount": 5}'}


@pytest.mark.parametrize("kind", KINDS)
def test_each_logical_request_gets_its_own_key(kind, server, fake):
    server.script.extend([answer(503), answer(200), answer(503), answer(200)])
    policy = make_policy(fake)

    call(kind, policy, "POST", server.url(), content=b"a")
    call(kind, policy, "POST", server.url(), content=b"b")

    keys = [seen.headers["idempotency-key"] for seen in server.seen]
    assert keys[0] == keys[1] != keys[2] == keys[3]


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_the_caller_sent_is_kept(kind, server, fake):
    server.script.append(answer(503))
    policy = make_policy(fake, key_header="X-Request-Key")

    call(kind, policy, "POST", server.url(), headers={"X-Request-Key": "order-7"}, content=b"a")

    assert [seen.headers["x-request-key"] for seen in server.seen] == ["order-7"] * 2
    assert all("idempotency-key" not in seen.headers for seen in server.seen)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_without_add_keys_a_request_without_a_key_is_not_retried(kind, method, server, fake):
    server.script.extend([answer(503), reset])

    result = call(kind, make_policy(fake, add_keys=False), method, server.url(), content=b"a")

    assert result.status == 503
    assert len(server.seen) == 1
    assert "idempotency-key" not in server.seen[0].headers
    assert fake.sleeps == []


@pytest.mark.parametrize("kind", KINDS)
def test_without_add_keys_a_request_with_a_key_is_retried(kind, server, fake):
    server.script.append(answer(503))
    headers = {"Idempotency-Key": "k-1"}

    call(kind, make_policy(fake, add_keys=False), "POST", server.url(), headers=headers)

    assert [seen.headers["idempotency-key"] for seen in server.seen] == ["k-1", "k-1"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "PUT", "DELETE"])
def test_idempotent_methods_are_retried_without_a_key(kind, method, server, fake):
    server.script.extend([answer(503), reset])
    content = b"replace" if method == "PUT" else None

    result = call(kind, make_policy(fake), method, server.url(), content=content)

    assert result.status == 200
    assert [seen.method for seen in server.seen] == [method] * 3
    assert all("idempotency-key" not in seen.headers for seen in server.seen)
    if method == "PUT":
        assert [seen.body for seen in server.seen] == [b"replace"] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_method_of_unknown_semantics_is_not_retried(kind, server, fake):
    server.script.append(answer(503))

    assert call(kind, make_policy(fake), "PURGE", server.url()).status == 503
    assert len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_current_correlation_id_goes_to_the_service_below(kind, server, fake):
    from django_idempotency.core.correlation import bind  # noqa: PLC0415

    server.script.extend([answer(503)])
    with bind("corr-7"):
        call(kind, make_policy(fake), "GET", server.url())
        call(kind, make_policy(fake), "GET", server.url(), headers={"X-Correlation-ID": "own"})
        call(kind, make_policy(fake, propagate=False), "GET", server.url())
    call(kind, make_policy(fake), "GET", server.url())

    # Every retry repeats it.
    assert [seen.headers.get("x-correlation-id") for seen in server.seen] == [
        "corr-7",
        "corr-7",
        "own",
        None,
        None,
    ]
