"""The httpx transports and clients (``client._httpx``)."""

from __future__ import annotations

import asyncio
from collections import deque

import httpx
import pytest

from django_idempotency.client import RetryTransport, retrying_async_client, retrying_client
from tests.client.helpers import answer, make_policy


def test_httpx_reads_a_streamed_body_so_that_a_retry_sends_it_again(server, fake):
    server.script.append(answer(503))

    def chunks():
        yield b"part one, "
        yield b"part two"

    with retrying_client(make_policy(fake)) as session:
        response = session.put(server.url(), content=chunks())

    assert response.status_code == 200
    assert [seen.body for seen in server.seen] == [b"part one, part two"] * 2


def test_async_httpx_reads_a_streamed_body_so_that_a_retry_sends_it_again(server, fake):
    server.script.append(answer(503))

    async def chunks():
        yield b"part one, "
        yield b"part two"

    async def main():
        async with retrying_async_client(make_policy(fake)) as session:
            return await session.put(server.url(), content=chunks())

    assert asyncio.run(main()).status_code == 200
    assert [seen.body for seen in server.seen] == [b"part one, part two"] * 2


def test_an_error_that_is_not_a_transport_error_is_not_retried(fake):
    calls = []

    def fail(request):
        calls.append(request)
        raise httpx.UnsupportedProtocol("no")

    transport = RetryTransport(httpx.MockTransport(fail), make_policy(fake))
    with httpx.Client(transport=transport) as session, pytest.raises(httpx.UnsupportedProtocol):
        session.get("http://example.test/")

    assert len(calls) == 1


def test_a_discarded_response_that_fails_to_read_is_still_closed(fake):
    class Broken(httpx.SyncByteStream):
        closed = False

        def __iter__(self):
            raise httpx.ReadError("reset while reading the body")

        def close(self):
            Broken.closed = True

    answers = deque([httpx.Response(503, stream=Broken()), httpx.Response(200)])
    transport = RetryTransport(
        httpx.MockTransport(lambda request: answers.popleft()), make_policy(fake)
    )
    with httpx.Client(transport=transport) as session:
        assert session.get("http://example.test/").status_code == 200

    assert Broken.closed


def test_retrying_client_wraps_its_transport_with_the_clients_options(server, fake):
    server.script.append(answer(503))

    with retrying_client(make_policy(fake), trust_env=False, timeout=2.0) as session:
        assert session.get(server.url()).status_code == 200
        assert session.trust_env is False

    assert len(server.seen) == 2


def test_retrying_client_wraps_a_given_transport(fake):
    answers = deque([httpx.Response(502), httpx.Response(201)])
    inner = httpx.MockTransport(lambda request: answers.popleft())

    with retrying_client(make_policy(fake), transport=inner) as session:
        assert session.get("http://example.test/").status_code == 201

    assert not answers


def test_retrying_async_client_wraps_a_given_transport(fake):
    answers = deque([httpx.Response(502), httpx.Response(201)])
    inner = httpx.MockTransport(lambda request: answers.popleft())

    async def main():
        async with retrying_async_client(make_policy(fake), transport=inner) as session:
            return await session.get("http://example.test/")

    assert asyncio.run(main()).status_code == 201
    assert not answers
