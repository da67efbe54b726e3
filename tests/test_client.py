"""The retrying client against a real loopback server that fails on cue.

Each test scripts the server's answers (503s, 429s with Retry-After, resets, a slow answer, then
200) and asserts what reached the server. Sleeps go to a fake clock, so no test waits for a
backoff.
"""

from __future__ import annotations

import asyncio
import email.utils
import gc
import importlib.util
import logging
import random
import socket
import struct
import sys
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import requests
from django.core.exceptions import ImproperlyConfigured
from requests.adapters import HTTPAdapter

import django_idempotency
from django_idempotency import client
from django_idempotency.backoff import exponential_bound
from django_idempotency.client import (
    RETRYABLE_STATUSES,
    AsyncRetryTransport,
    CircuitBreaker,
    CircuitBreakers,
    CircuitOpen,
    RetryAdapter,
    RetryBudget,
    RetryBudgets,
    RetryPolicy,
    RetryTransport,
    retrying_async_client,
    retrying_client,
    retrying_session,
)
from django_idempotency.client._policy import parse_retry_after

KINDS = ["httpx", "async", "requests"]
WALL = 1_700_000_000.0  # the wall clock's fixed "now", for HTTP-date Retry-After values
BIG = 100 * 1024  # a body longer than the client drains


# --- the server -------------------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: tuple[str, int]


def answer(status, headers=None, body=b"", advance=0.0):
    """Answer ``status``; ``advance`` moves the fake clock, as a slow server would."""

    def act(handler):
        handler.server.time.now += advance
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)

    return act


def reset(handler):
    """Close the connection with a TCP reset, without answering."""
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.close_connection = True
    handler.connection.close()


def drop(handler):
    """Close the connection cleanly, without answering."""
    handler.close_connection = True


def slow(handler):
    """Answer 200, but only after the client's timeout has passed."""
    handler.server.release.wait(5)
    answer(200, body=b"late")(handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10  # a keep-alive connection left open does not hold its thread forever

    def serve(self):
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = self._read_chunked()
        else:
            body = self.rfile.read(length)
        server = self.server
        server.seen.append(
            Seen(
                method=self.command,
                path=self.path,
                headers={name.lower(): value for name, value in self.headers.items()},
                body=body,
                connection=self.client_address,
            )
        )
        action = server.script.popleft() if server.script else answer(200, body=b"ok")
        action(self)

    def _read_chunked(self):
        body = b""
        while size := int(self.rfile.readline().strip(), 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        self.rfile.readline()
        return body

    do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_PURGE = serve

    def log_message(self, format, *args):
        pass


class FlakyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, time):
        super().__init__(("127.0.0.1", 0), Handler)
        self.time = time
        self.script = deque()
        self.seen = []
        self.release = threading.Event()

    def handle_error(self, request, client_address):
        # The client gave up on a slow answer or a reset connection: expected, not a failure.
        pass

    def url(self, path="/thing"):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}{path}"

    @property
    def host(self):
        host, port = self.server_address[:2]
        return f"{host}:{port}"


@dataclass
class FakeTime:
    now: float = 1000.0
    sleeps: list[float] = field(default_factory=list)

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    async def async_sleep(self, seconds):
        self.sleep(seconds)


@pytest.fixture
def fake():
    return FakeTime()


@pytest.fixture
def server(fake):
    httpd = FlakyServer(fake)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01})
    thread.start()
    yield httpd
    httpd.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def make_policy(fake, **overrides):
    settings = {
        "base_delay": 0.1,
        "max_delay": 10.0,
        "budget": RetryBudgets(clock=fake.clock),
        "breaker": CircuitBreakers(clock=fake.clock),
        "clock": fake.clock,
        "wall_clock": lambda: WALL,
        "sleep": fake.sleep,
        "async_sleep": fake.async_sleep,
        "random": lambda: 0.5,
    }
    return RetryPolicy(**{**settings, **overrides})


# --- the three clients ------------------------------------------------------------------------


@dataclass
class Result:
    status: int
    body: bytes


def call(kind, policy, method, url, *, headers=None, content=None, timeout=5.0):
    """Send one request through the retrying client ``kind``; return its final response."""
    if kind == "httpx":
        with httpx.Client(transport=RetryTransport(policy=policy), timeout=timeout) as session:
            response = session.request(method, url, headers=headers, content=content)
            return Result(response.status_code, response.content)
    if kind == "async":

        async def main():
            transport = AsyncRetryTransport(policy=policy)
            async with httpx.AsyncClient(transport=transport, timeout=timeout) as session:
                response = await session.request(method, url, headers=headers, content=content)
                return Result(response.status_code, response.content)

        return asyncio.run(main())
    with requests.Session() as session:
        session.mount("http://", RetryAdapter(policy))
        response = session.request(method, url, headers=headers, data=content, timeout=timeout)
        return Result(response.status_code, response.content)


TRANSPORT_ERRORS = {
    "httpx": httpx.TransportError,
    "async": httpx.TransportError,
    "requests": requests.ConnectionError,
}


# --- what is retried --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_503s_are_retried_until_the_200(kind, server, fake):
    server.script.extend([answer(503), answer(503, body=b"busy")])

    result = call(kind, make_policy(fake), "GET", server.url())

    assert (result.status, result.body) == (200, b"ok")
    assert [seen.method for seen in server.seen] == ["GET"] * 3
    assert fake.sleeps == pytest.approx([0.05, 0.1])


@pytest.mark.parametrize("kind", KINDS)
def test_when_attempts_run_out_the_last_response_is_returned(kind, server, fake):
    server.script.extend([answer(503, body=f"try {n}".encode()) for n in range(1, 10)])

    result = call(kind, make_policy(fake, max_attempts=4), "GET", server.url())

    assert (result.status, result.body) == (503, b"try 4")
    assert len(server.seen) == 4
    assert len(fake.sleeps) == 3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 504, 599])
def test_every_retryable_status_is_retried(kind, status, server, fake):
    server.script.append(answer(status))

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [400, 401, 404, 409, 422, 501, 505])
def test_other_client_errors_and_permanent_server_errors_are_not_retried(
    kind, status, server, fake
):
    server.script.append(answer(status, body=b"no"))

    result = call(kind, make_policy(fake), "GET", server.url())

    assert (result.status, result.body) == (status, b"no")
    assert len(server.seen) == 1
    assert fake.sleeps == []


def test_the_retryable_statuses():
    assert {408, 425, 429, 500, 502, 503, 504, 599} <= RETRYABLE_STATUSES
    assert not {200, 301, 400, 404, 409, 422, 501, 505} & RETRYABLE_STATUSES


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("failure", [reset, drop], ids=["reset", "drop"])
def test_a_connection_closed_without_an_answer_is_retried(kind, failure, server, fake):
    server.script.append(failure)

    result = call(kind, make_policy(fake), "GET", server.url())

    assert (result.status, result.body) == (200, b"ok")
    assert len(server.seen) == 2
    assert len(fake.sleeps) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_timeout_is_retried(kind, server, fake):
    server.script.append(slow)

    result = call(kind, make_policy(fake), "GET", server.url(), timeout=0.3)

    assert (result.status, result.body) == (200, b"ok")
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_when_attempts_run_out_the_last_error_is_raised(kind, server, fake):
    server.script.extend([reset, drop, reset, drop])

    with pytest.raises(TRANSPORT_ERRORS[kind]):
        call(kind, make_policy(fake, max_attempts=3), "GET", server.url())

    assert len(server.seen) == 3
    assert len(fake.sleeps) == 2


# --- methods and keys -------------------------------------------------------------------------


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


def test_requests_sends_a_streamed_body_once(server, fake):
    server.script.append(answer(503))

    with retrying_session(make_policy(fake)) as session:
        response = session.put(server.url(), data=iter([b"part one, ", b"part two"]))

    assert response.status_code == 503
    assert [seen.body for seen in server.seen] == [b"part one, part two"]


# --- delays -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("jitter", "expected"),
    [
        ("full", [0.05, 0.1, 0.2, 0.4]),
        ("equal", [0.075, 0.15, 0.3, 0.6]),
        # From previous = base = 0.1: 0.1 + 0.5 * (3 * previous - 0.1).
        ("decorrelated", [0.2, 0.35, 0.575, 0.9125]),
    ],
)
def test_each_jitter_draws_its_own_delays(kind, jitter, expected, server, fake):
    server.script.extend([answer(503)] * 4)

    call(kind, make_policy(fake, jitter=jitter, max_attempts=5), "GET", server.url())

    assert fake.sleeps == pytest.approx(expected)
    assert len(server.seen) == 5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jitter", ["full", "equal", "decorrelated"])
def test_random_delays_stay_within_their_jitters_bounds(kind, jitter, server, fake):
    attempts = 8
    server.script.extend([answer(503)] * attempts)
    policy = make_policy(
        fake,
        jitter=jitter,
        max_attempts=attempts,
        base_delay=0.5,
        max_delay=6.0,
        random=random.Random(7).random,  # noqa: S311 - a seeded draw, not a secret
    )

    call(kind, policy, "GET", server.url())

    assert len(fake.sleeps) == attempts - 1
    previous = 0.5
    for attempt, delay in enumerate(fake.sleeps, start=1):
        bound = exponential_bound(attempt, 0.5, 6.0)
        if jitter == "full":
            assert 0 <= delay <= bound
        elif jitter == "equal":
            assert bound / 2 <= delay <= bound
        else:
            assert 0.5 <= delay <= min(6.0, 3 * previous)
            previous = delay
    assert max(fake.sleeps) <= 6.0


@pytest.mark.parametrize("kind", KINDS)
def test_retry_after_in_seconds_is_the_least_wait(kind, server, fake):
    server.script.append(answer(429, {"Retry-After": "2"}))

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert fake.sleeps == [2.0]
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_409_in_progress_with_retry_after_is_retried_with_the_same_key(kind, server, fake):
    # What a server running this library answers while the first request with the key runs.
    server.script.append(answer(409, {"Retry-After": "1"}, b'{"code":"idempotency.in_progress"}'))

    result = call(kind, make_policy(fake), "POST", server.url(), content=b"{}")

    assert result.status == 200
    assert fake.sleeps == [1.0]
    keys = [seen.headers["idempotency-key"] for seen in server.seen]
    assert len(keys) == 2
    assert keys[0] == keys[1]


@pytest.mark.parametrize("kind", KINDS)
def test_a_409_without_retry_after_is_a_final_answer(kind, server, fake):
    server.script.append(answer(409, body=b"conflict"))

    result = call(kind, make_policy(fake), "POST", server.url(), content=b"{}")

    assert (result.status, result.body) == (409, b"conflict")
    assert len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_409_with_retry_after_but_no_key_is_not_retried(kind, server, fake):
    server.script.append(answer(409, {"Retry-After": "1"}))

    result = call(kind, make_policy(fake, add_keys=False), "POST", server.url(), content=b"{}")

    assert result.status == 409
    assert len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_retry_after_as_an_http_date(kind, server, fake):
    server.script.append(
        answer(503, {"Retry-After": email.utils.formatdate(WALL + 5, usegmt=True)})
    )

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert fake.sleeps == [5.0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "value",
    [email.utils.formatdate(WALL - 60, usegmt=True), "0", "soon", "1.5", "-3"],
    ids=["past-date", "zero", "word", "fraction", "negative"],
)
def test_retry_after_in_the_past_or_malformed_leaves_the_backoff(kind, value, server, fake):
    server.script.append(answer(503, {"Retry-After": value}))

    assert call(kind, make_policy(fake), "GET", server.url()).status == 200
    assert fake.sleeps == [0.05]


@pytest.mark.parametrize("kind", KINDS)
def test_a_retry_after_shorter_than_the_backoff_does_not_shorten_it(kind, server, fake):
    server.script.append(answer(503, {"Retry-After": "1"}))

    call(kind, make_policy(fake, base_delay=4.0, random=lambda: 0.75), "GET", server.url())

    assert fake.sleeps == [3.0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "value", ["11", "99999999999999999999999", "Fri, 31 Dec 9999 23:59:59 GMT"]
)
def test_a_retry_after_beyond_max_delay_returns_the_response_at_once(kind, value, server, fake):
    server.script.append(answer(429, {"Retry-After": value}, b"slow down"))

    result = call(kind, make_policy(fake, max_delay=10.0), "GET", server.url())

    assert (result.status, result.body) == (429, b"slow down")
    assert len(server.seen) == 1
    assert fake.sleeps == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_retry_after_equal_to_max_delay_is_waited(kind, server, fake):
    server.script.append(answer(429, {"Retry-After": "10"}))

    assert call(kind, make_policy(fake, max_delay=10.0), "GET", server.url()).status == 200
    assert fake.sleeps == [10.0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_retry_after_past_the_deadline_returns_the_response_at_once(kind, server, fake):
    server.script.append(answer(503, {"Retry-After": "8"}))

    result = call(kind, make_policy(fake, deadline=5.0), "GET", server.url())

    assert result.status == 503
    assert len(server.seen) == 1
    assert fake.sleeps == []


def test_retry_after_values():
    parse = parse_retry_after
    assert parse(" 7 ", WALL) == 7.0
    assert parse("Wed, 15 Nov 2023 00:00:00 GMT", 1_700_006_400.0 - 30) == 30.0
    # "-0000" makes a naive datetime; HTTP-dates are GMT all the same.
    assert parse("Wed, 15 Nov 2023 00:00:00 -0000", 1_700_006_400.0 - 30) == 30.0
    assert parse("Wed, 15 Nov 2023 00:00:00 GMT", 1_700_006_400.0 + 30) == 0.0
    assert parse("\u00b2", WALL) is None
    assert parse("", WALL) is None
    assert parse("9" * 5000, WALL) == float("inf")


# --- the deadline -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_no_wait_ends_past_the_deadline(kind, server, fake):
    server.script.extend([answer(503)] * 5)
    policy = make_policy(fake, base_delay=1.0, random=lambda: 1.0, deadline=2.5, max_attempts=10)

    result = call(kind, policy, "GET", server.url())

    # Waits of 1 then 2 seconds: the second would end at 3 s, past the 2.5 s deadline.
    assert result.status == 503
    assert fake.sleeps == [1.0]
    assert len(server.seen) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_time_spent_in_attempts_counts_towards_the_deadline(kind, server, fake):
    server.script.extend([answer(503, advance=9.8), answer(503)])

    result = call(kind, make_policy(fake, deadline=10.0, base_delay=1.0), "GET", server.url())

    assert result.status == 503
    assert len(server.seen) == 1
    assert fake.sleeps == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_wait_that_ends_at_the_deadline_is_not_taken(kind, server, fake):
    server.script.append(answer(503))

    policy = make_policy(fake, base_delay=2.0, random=lambda: 1.0, deadline=2.0)

    assert call(kind, policy, "GET", server.url()).status == 503
    assert fake.sleeps == []


@pytest.mark.parametrize("kind", KINDS)
def test_the_last_attempt_gets_what_is_left_of_the_deadline(kind, server, fake):
    server.script.append(answer(503))

    policy = make_policy(fake, base_delay=2.0, random=lambda: 1.0, deadline=2.5)

    assert call(kind, policy, "GET", server.url()).status == 200
    assert fake.sleeps == [2.0]
    # Each attempt tells the server how long the client still waits for its answer.
    assert [seen.headers["request-timeout-ms"] for seen in server.seen] == ["2500", "500"]


# --- the retry budget -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_budget_fails_fast_with_the_response(kind, server, fake):
    server.script.extend([answer(503), answer(503)])
    budgets = RetryBudgets(min_retries_per_second=0, percent_can_retry=0.0, clock=fake.clock)

    result = call(kind, make_policy(fake, budget=budgets), "GET", server.url())

    assert result.status == 503
    assert len(server.seen) == 1
    assert fake.sleeps == []


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_budget_fails_fast_with_the_error(kind, server, fake):
    server.script.extend([reset, reset])
    budgets = RetryBudgets(min_retries_per_second=0, percent_can_retry=0.0, clock=fake.clock)

    with pytest.raises(TRANSPORT_ERRORS[kind]):
        call(kind, make_policy(fake, budget=budgets), "GET", server.url())

    assert len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_reserve_allows_exactly_its_retries_then_refills(kind, server, fake):
    # 0.2 retries a second over 10 seconds: a reserve of exactly 2 retries.
    budgets = RetryBudgets(
        ttl=10.0, min_retries_per_second=0.2, percent_can_retry=0.0, clock=fake.clock
    )
    policy = make_policy(fake, budget=budgets, max_attempts=10, deadline=1000.0)
    server.script.extend([answer(503)] * 20)

    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 3
    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 4

    fake.now += 10.0
    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 7


@pytest.mark.parametrize("kind", KINDS)
def test_first_attempts_earn_retries_in_proportion(kind, server, fake):
    budgets = RetryBudgets(min_retries_per_second=0, percent_can_retry=0.25, clock=fake.clock)
    policy = make_policy(fake, budget=budgets, max_attempts=10)
    for _ in range(7):
        assert call(kind, policy, "GET", server.url()).status == 200

    # Seven first attempts, and the eighth: 8 x 0.25 = 2 retries.
    server.script.extend([answer(503)] * 5)
    assert call(kind, policy, "GET", server.url()).status == 503
    assert len(server.seen) == 7 + 3


@pytest.mark.parametrize("kind", KINDS)
def test_no_budget_means_no_limit_but_the_attempts(kind, server, fake):
    server.script.extend([answer(503)] * 5)

    call(kind, make_policy(fake, budget=None, max_attempts=6), "GET", server.url())

    assert len(server.seen) == 6


def test_hosts_have_separate_budgets(fake):
    budgets = RetryBudgets(min_retries_per_second=0.1, clock=fake.clock)

    assert budgets.budget_for("a.test") is budgets.budget_for("a.test")
    assert budgets.budget_for("a.test").try_withdraw()
    assert not budgets.budget_for("a.test").try_withdraw()
    assert budgets.budget_for("b.test").try_withdraw()
    assert budgets.budget_for("a.test:8443").try_withdraw()


def test_a_budget_counts_exactly(fake):
    budget = RetryBudget(min_retries_per_second=0, percent_can_retry=0.1, clock=fake.clock)
    for _ in range(9):
        budget.deposit()
    assert budget.balance == pytest.approx(0.9)
    assert not budget.try_withdraw()

    budget.deposit()
    assert budget.balance == 1.0
    assert budget.try_withdraw()
    assert budget.balance == 0.0
    assert not budget.try_withdraw()


def test_deposits_expire_after_the_ttl(fake):
    budget = RetryBudget(
        ttl=10.0, min_retries_per_second=0, percent_can_retry=1.0, clock=fake.clock
    )
    budget.deposit()
    fake.now += 5.0
    budget.deposit()
    assert budget.balance == 2.0

    fake.now += 5.0
    assert budget.balance == 1.0
    fake.now += 4.999
    assert budget.balance == 1.0
    fake.now += 0.001
    assert budget.balance == 0.0
    assert not budget.try_withdraw()


def test_withdrawals_expire_so_the_reserve_refills(fake):
    budget = RetryBudget(
        ttl=2.0, min_retries_per_second=1.0, percent_can_retry=0.0, clock=fake.clock
    )
    assert budget.balance == 2.0
    assert budget.try_withdraw()
    fake.now += 1.0
    assert budget.try_withdraw()
    assert not budget.try_withdraw()

    fake.now += 1.0
    assert budget.balance == 1.0
    assert budget.try_withdraw()
    assert not budget.try_withdraw()


def test_a_budget_is_safe_across_threads():
    budget = RetryBudget(ttl=60.0, min_retries_per_second=0, percent_can_retry=0.5)
    granted = []

    def work():
        for _ in range(1000):
            budget.deposit()
            granted.append(budget.try_withdraw())

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # 8000 deposits of half a token: every one of the 4000 tokens is either spent or still there,
    # however the threads interleave.
    assert granted.count(True) + budget.balance == 4000
    assert 0 <= budget.balance < 8


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"ttl": 0}, "ttl must be positive"),
        ({"min_retries_per_second": -1}, "must not be negative"),
        ({"percent_can_retry": -0.1}, "must not be negative"),
    ],
)
def test_budget_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        RetryBudget(**settings)
    with pytest.raises(ValueError, match=message):
        RetryBudgets(**settings)


# --- the circuit breaker ----------------------------------------------------------------------


def breaker_policy(fake, *, failure_threshold=3, window=30.0, cool_down=5.0, **overrides):
    breakers = CircuitBreakers(
        failure_threshold=failure_threshold, window=window, cool_down=cool_down, clock=fake.clock
    )
    return make_policy(fake, **{"breaker": breakers, "max_attempts": 1, **overrides})


def open_circuit(kind, server, policy, failures=3):
    server.script.extend([answer(503)] * failures)
    for _ in range(failures):
        assert call(kind, policy, "GET", server.url()).status == 503


def fail_fast(kind, server, policy, url=None):
    """Call, expecting CircuitOpen without the server seeing the request; return the error."""
    seen = len(server.seen)
    with pytest.raises(CircuitOpen) as raised:
        call(kind, policy, "GET", url or server.url())
    assert len(server.seen) == seen
    assert isinstance(raised.value, TRANSPORT_ERRORS[kind])
    return raised.value


@pytest.mark.parametrize("kind", KINDS)
def test_the_circuit_opens_after_n_failures_in_a_row_then_fails_fast(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)

    error = fail_fast(kind, server, policy)

    assert (error.host, error.retry_in) == (server.host, 5.0)
    assert str(error) == f"circuit open for {server.host}: failing fast, next trial in 5.000 s"
    assert fake.sleeps == []  # failing fast waits for nothing: not the cool-down, nor a backoff
    breaker = policy.breaker.breaker_for(server.host)
    assert (breaker.state, breaker.opened, breaker.rejected) == ("open", 1, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_a_success_between_failures_keeps_the_circuit_closed(kind, server, fake):
    policy = breaker_policy(fake)
    server.script.extend([answer(500), answer(502), answer(404), answer(504), answer(503)])

    statuses = [call(kind, policy, "GET", server.url()).status for _ in range(6)]

    assert statuses == [500, 502, 404, 504, 503, 200]
    assert policy.breaker.breaker_for(server.host).state == "closed"


@pytest.mark.parametrize("kind", KINDS)
def test_failures_further_apart_than_the_window_are_forgotten(kind, server, fake):
    policy = breaker_policy(fake, window=30.0)
    server.script.extend([answer(503)] * 3)

    statuses = [call(kind, policy, "GET", server.url()).status]
    fake.now += 30.0
    statuses += [call(kind, policy, "GET", server.url()).status for _ in range(3)]

    # The first failure was 30 s old when the third came: two failures in the window, not three.
    assert statuses == [503, 503, 503, 200]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("status", [408, 425, 429, 409, 501])
def test_statuses_that_do_not_blame_the_host_do_not_count(kind, status, server, fake):
    policy = breaker_policy(fake, failure_threshold=1)
    server.script.append(answer(status))

    assert call(kind, policy, "GET", server.url()).status == status
    assert call(kind, policy, "GET", server.url()).status == 200


@pytest.mark.parametrize("kind", KINDS)
def test_transport_errors_count(kind, server, fake):
    policy = breaker_policy(fake, failure_threshold=2)
    server.script.extend([reset, drop])
    for _ in range(2):
        with pytest.raises(TRANSPORT_ERRORS[kind]):
            call(kind, policy, "GET", server.url())

    fail_fast(kind, server, policy)


@pytest.mark.parametrize("kind", KINDS)
def test_after_the_cool_down_a_successful_trial_closes_the_circuit(kind, server, fake, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.client")
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    fake.now += 4.5
    assert fail_fast(kind, server, policy).retry_in == pytest.approx(0.5)
    fake.now += 0.5
    assert policy.breaker.breaker_for(server.host).state == "half_open"

    assert call(kind, policy, "GET", server.url()).status == 200
    assert call(kind, policy, "GET", server.url()).status == 200

    assert policy.breaker.breaker_for(server.host).state == "closed"
    changes = [
        (r.levelno, r.idempotency_client_circuit, r.getMessage())
        for r in caplog.records
        if hasattr(r, "idempotency_client_circuit")
    ]
    assert changes == [
        (logging.WARNING, "open", f"circuit open for {server.host}: failing fast for 5.000 s"),
        (
            logging.INFO,
            "half_open",
            f"circuit half-open for {server.host}: sending one trial request",
        ),
        (logging.INFO, "closed", f"circuit closed for {server.host}: the trial request succeeded"),
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_trial_opens_the_circuit_again(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    fake.now += 5.0
    server.script.append(answer(503))

    assert call(kind, policy, "GET", server.url()).status == 503

    assert fail_fast(kind, server, policy).retry_in == 5.0
    assert policy.breaker.breaker_for(server.host).opened == 2


def test_half_open_lets_exactly_one_trial_through_across_threads(server, fake):
    policy = breaker_policy(fake)
    open_circuit("httpx", server, policy)
    fake.now += 5.0
    server.script.append(slow)  # the trial's answer waits until the others have failed fast
    outcomes = []
    start = threading.Barrier(8)

    def work(kind):
        start.wait()
        try:
            outcomes.append(call(kind, policy, "GET", server.url(), timeout=10.0))
        except CircuitOpen as error:
            outcomes.append(error)

    threads = [threading.Thread(target=work, args=(KINDS[i % 3],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for _ in range(500):
        if len(outcomes) == 7:
            break
        threading.Event().wait(0.01)
    server.release.set()
    for thread in threads:
        thread.join()

    errors = [o for o in outcomes if isinstance(o, CircuitOpen)]
    assert [o.status for o in outcomes if isinstance(o, Result)] == [200]
    assert [error.retry_in for error in errors] == [0.0] * 7
    assert "while a trial request runs" in str(errors[0])
    assert len(server.seen) == 4
    assert policy.breaker.breaker_for(server.host).state == "closed"


def test_async_half_open_lets_exactly_one_trial_through(server, fake):
    policy = breaker_policy(fake)
    open_circuit("async", server, policy)
    fake.now += 5.0
    server.script.append(slow)

    async def main():
        transport = AsyncRetryTransport(policy=policy)
        async with httpx.AsyncClient(transport=transport, timeout=10.0) as session:
            trial = asyncio.create_task(session.get(server.url()))
            while not server.seen[3:]:  # the trial has reached the server
                await asyncio.sleep(0.01)
            others = await asyncio.gather(
                *(session.get(server.url()) for _ in range(5)), return_exceptions=True
            )
            server.release.set()
            return (await trial).status_code, others

    status, others = asyncio.run(main())

    assert status == 200
    assert all(isinstance(error, CircuitOpen) for error in others)
    assert len(server.seen) == 4


def test_a_trial_that_says_nothing_of_the_host_leaves_the_next_request_the_trial(fake):
    breaker = CircuitBreaker("example.test", failure_threshold=1, cool_down=5.0, clock=fake.clock)
    breaker.record(breaker.admit(), "failure")
    fake.now += 5.0
    trial = breaker.admit()
    assert trial.trial
    assert not breaker.admit().allowed

    breaker.record(trial, "neither")  # cancelled, say

    assert breaker.state == "half_open"
    assert breaker.admit().trial


def test_only_the_trial_decides_once_the_circuit_is_open(fake):
    breaker = CircuitBreaker("example.test", failure_threshold=2, clock=fake.clock)
    early = breaker.admit()  # let through while the circuit was closed, answered after it opened
    breaker.record(breaker.admit(), "failure")
    breaker.record(breaker.admit(), "failure")

    breaker.record(early, "success")

    assert breaker.state == "open"


def test_a_cancelled_async_trial_frees_the_trial(server, fake):
    policy = breaker_policy(fake)
    open_circuit("async", server, policy)
    fake.now += 5.0
    server.script.append(slow)

    async def main():
        transport = AsyncRetryTransport(policy=policy)
        async with httpx.AsyncClient(transport=transport, timeout=10.0) as session:
            trial = asyncio.create_task(session.get(server.url()))
            while not server.seen[3:]:
                await asyncio.sleep(0.01)
            trial.cancel()
            with pytest.raises(asyncio.CancelledError):
                await trial
            server.release.set()
            return (await session.get(server.url())).status_code

    assert asyncio.run(main()) == 200
    assert policy.breaker.breaker_for(server.host).state == "closed"


@pytest.mark.parametrize("kind", KINDS)
def test_circuits_are_per_host(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    fail_fast(kind, server, policy)

    other = server.url().replace("127.0.0.1", "localhost")
    assert call(kind, policy, "GET", other).status == 200


@pytest.mark.parametrize("kind", KINDS)
def test_retries_stop_once_the_circuit_opens(kind, server, fake, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.client")
    policy = breaker_policy(fake, max_attempts=6)
    server.script.extend([answer(503)] * 6)

    assert call(kind, policy, "GET", server.url()).status == 503

    assert len(server.seen) == 3
    assert caplog.records[-1].idempotency_client_stop == "circuit_open"
    # One first attempt deposited 0.2 of a token and two retries spent one each; the retry the
    # circuit stopped spent nothing.
    assert policy.budget.budget_for(server.host).balance == pytest.approx(100.0 + 0.2 - 2)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_failed_fast_earns_no_retries(kind, server, fake):
    policy = breaker_policy(fake)
    open_circuit(kind, server, policy)
    budget = policy.budget.budget_for(server.host)
    balance = budget.balance

    fail_fast(kind, server, policy)

    assert budget.balance == balance


@pytest.mark.parametrize("kind", KINDS)
def test_a_circuit_that_opens_during_the_wait_ends_the_retries(kind, server, fake, caplog):
    caplog.set_level(logging.INFO, logger="django_idempotency.client")

    # Other requests' failures open the circuit while this one waits to retry.
    def opened_meanwhile(seconds):
        fake.sleep(seconds)
        breaker = policy.breaker.breaker_for(server.host)
        for _ in range(3):
            breaker.record(breaker.admit(), "failure")

    async def async_opened_meanwhile(seconds):
        opened_meanwhile(seconds)

    policy = breaker_policy(
        fake, max_attempts=4, sleep=opened_meanwhile, async_sleep=async_opened_meanwhile
    )
    server.script.append(answer(503))

    with pytest.raises(CircuitOpen):
        call(kind, policy, "GET", server.url())
    assert len(server.seen) == 1
    # The refused attempt is not a failure to retry, whichever library's error it is.
    attempts = [r.idempotency_client_attempt for r in caplog.records if r.msg.startswith("retry")]
    assert attempts == [1]
    assert not [r for r in caplog.records if r.msg.startswith("not retrying")]


@pytest.mark.parametrize("kind", KINDS)
def test_no_breaker_means_no_circuit(kind, server, fake):
    policy = make_policy(fake, breaker=None, max_attempts=1)
    server.script.extend([answer(503)] * 20)

    statuses = [call(kind, policy, "GET", server.url()).status for _ in range(21)]

    assert statuses == [503] * 20 + [200]


@pytest.mark.django_db  # a scrape also reads the backlog gauges from the database
def test_circuit_states_and_counts_are_metrics(server, fake):
    from prometheus_client import REGISTRY  # noqa: PLC0415 - an extra, as for users

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, {"host": server.host, **labels})

    policy = breaker_policy(fake)
    open_circuit("httpx", server, policy)
    fail_fast("httpx", server, policy)
    fail_fast("httpx", server, policy)
    # A second policy's breakers for the same host add to the counts.
    other = breaker_policy(fake)
    assert call("httpx", other, "GET", server.url()).status == 200

    circuits = "django_idempotency_client_circuits"
    assert sample(circuits, state="open") == 1
    assert sample(circuits, state="closed") == 1
    assert sample(circuits, state="half_open") == 0
    assert sample("django_idempotency_client_circuit_opened_total") == 1
    assert sample("django_idempotency_client_circuit_rejected_total") == 2
    fake.now += 5.0
    assert sample(circuits, state="half_open") == 1
    # The breakers of a policy that is gone leave the metrics with it.
    del other
    gc.collect()
    assert sample(circuits, state="closed") == 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"failure_threshold": 0}, "failure_threshold must be at least 1"),
        ({"window": 0}, "window and cool_down must be positive"),
        ({"cool_down": -1.0}, "window and cool_down must be positive"),
    ],
)
def test_breaker_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        CircuitBreakers(**settings)
    with pytest.raises(ValueError, match=message):
        CircuitBreaker(**settings)


# --- the policy -------------------------------------------------------------------------------


def test_the_policys_defaults():
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.base_delay, policy.max_delay, policy.deadline) == (
        4,
        0.1,
        10.0,
        30.0,
    )
    assert (policy.jitter, policy.key_header, policy.add_keys) == ("full", "Idempotency-Key", True)
    assert isinstance(policy.budget, RetryBudgets)
    assert RetryPolicy().budget is policy.budget
    assert isinstance(policy.breaker, CircuitBreakers)
    assert RetryPolicy().breaker is policy.breaker
    breaker = policy.breaker.breaker_for("defaults.example")
    assert (breaker.failure_threshold, breaker.window, breaker.cool_down) == (10, 30.0, 10.0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"base_delay": -1.0}, "base_delay"),
        ({"base_delay": 20.0, "max_delay": 10.0}, "base_delay"),
        ({"deadline": 0}, "deadline"),
        ({"jitter": "none"}, "jitter"),
        ({"key_header": ""}, "key_header"),
    ],
)
def test_policy_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**settings)


@pytest.mark.parametrize("kind", KINDS)
def test_max_attempts_of_one_never_retries(kind, server, fake):
    server.script.append(answer(503))

    assert call(kind, make_policy(fake, max_attempts=1), "GET", server.url()).status == 503
    assert len(server.seen) == 1


# --- connections, errors and logs -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_discarded_response_is_read_so_its_connection_is_reused(kind, server, fake):
    server.script.extend([answer(503, body=b"x" * 1000)] * 2)

    call(kind, make_policy(fake), "GET", server.url())

    assert len(server.seen) == 3
    assert len({seen.connection for seen in server.seen}) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_discarded_response_with_a_long_body_is_closed_unread(kind, server, fake):
    server.script.extend([answer(503, body=b"x" * BIG)] * 2)

    assert call(kind, make_policy(fake), "GET", server.url()).body == b"ok"
    assert len({seen.connection for seen in server.seen}) == 3


def test_an_error_that_is_not_a_transport_error_is_not_retried(fake):
    calls = []

    def fail(request):
        calls.append(request)
        raise httpx.UnsupportedProtocol("no")

    transport = RetryTransport(httpx.MockTransport(fail), make_policy(fake))
    with httpx.Client(transport=transport) as session, pytest.raises(httpx.UnsupportedProtocol):
        session.get("http://example.test/")

    assert len(calls) == 1


def test_requests_does_not_retry_a_tls_error(monkeypatch, fake):
    calls = []

    def fail(self, request, **kwargs):
        calls.append(request)
        raise requests.exceptions.SSLError("certificate verify failed")

    monkeypatch.setattr(HTTPAdapter, "send", fail)
    with (
        retrying_session(make_policy(fake)) as session,
        pytest.raises(requests.exceptions.SSLError),
    ):
        session.get("https://example.test/")

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


def test_each_retry_is_logged_without_header_values(server, fake, caplog):
    server.script.extend([answer(503), reset, answer(429, {"Retry-After": "1"})])
    caplog.set_level(logging.INFO, logger="django_idempotency.client")

    call("httpx", make_policy(fake), "POST", server.url(), content=b"secret body")

    key = server.seen[0].headers["idempotency-key"]
    retries = [r for r in caplog.records if r.name == "django_idempotency.client"]
    assert [r.levelno for r in retries] == [logging.INFO] * 3
    assert [r.idempotency_client_attempt for r in retries] == [1, 2, 3]
    assert [r.idempotency_client_reason for r in retries] == [
        "status 503",
        "ReadError",
        "status 429",
    ]
    assert [r.idempotency_client_delay for r in retries] == pytest.approx([0.05, 0.1, 1.0])
    assert {r.idempotency_client_host for r in retries} == {server.host}
    for record in retries:
        text = repr(vars(record)) + record.getMessage()
        assert key not in text
        assert "secret body" not in text


def test_giving_up_is_logged_with_the_reason(server, fake, caplog):
    server.script.extend([answer(503), answer(429, {"Retry-After": "60"})])
    caplog.set_level(logging.INFO, logger="django_idempotency.client")

    call("requests", make_policy(fake), "GET", server.url())

    last = caplog.records[-1]
    assert last.getMessage() == (
        f"not retrying GET {server.host} after attempt 2 (status 429): retry_after"
    )
    assert (last.idempotency_client_stop, last.idempotency_client_delay) == ("retry_after", 60.0)


def test_a_url_without_a_port_is_budgeted_and_logged_by_host_name(fake, caplog):
    answers = deque([httpx.Response(503), httpx.Response(200)])
    transport = RetryTransport(
        httpx.MockTransport(lambda request: answers.popleft()), make_policy(fake)
    )
    caplog.set_level(logging.INFO, logger="django_idempotency.client")

    with httpx.Client(transport=transport) as session:
        session.get("https://example.test/path")

    assert [r.idempotency_client_host for r in caplog.records] == ["example.test"]


# --- the convenience constructors and optional imports ----------------------------------------


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


def test_the_default_policy_retries(server):
    server.script.append(answer(503))

    with retrying_session() as session:
        assert session.get(server.url()).status_code == 200
    server.script.append(answer(503))
    with httpx.Client(transport=RetryTransport()) as session:
        assert session.get(server.url()).status_code == 200

    assert len(server.seen) == 4


def load_client(monkeypatch, *missing):
    """Import the client package afresh, with ``missing`` modules not installed."""
    for name in missing:
        monkeypatch.setitem(sys.modules, name, None)
    package = client.__name__
    for name in [name for name in sys.modules if name.startswith(f"{package}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, package)
    # The import binds the fresh package to its parent's attribute: the test's end restores it.
    monkeypatch.setattr(django_idempotency, "client", client)
    return importlib.import_module(package)


def test_public_names_belong_to_the_package():
    assert sorted(client.__all__) == sorted(
        [
            "RETRYABLE_STATUSES",
            "AsyncRetryTransport",
            "CircuitBreaker",
            "CircuitBreakers",
            "CircuitOpen",
            "RetryAdapter",
            "RetryBudget",
            "RetryBudgets",
            "RetryPolicy",
            "RetryTransport",
            "retrying_async_client",
            "retrying_client",
            "retrying_session",
        ]
    )
    for name in client.__all__:
        value = getattr(client, name)
        if callable(value):
            assert value.__module__ == "django_idempotency.client", name
    assert repr(RetryPolicy().budget).startswith("<django_idempotency.client.RetryBudgets object")
    assert {"IDEMPOTENT_METHODS", "KEYED_METHODS", "Jitter", "logger"} <= set(vars(client))


def test_the_module_imports_without_httpx(monkeypatch):
    module = load_client(monkeypatch, "httpx")
    assert hasattr(module, "RetryAdapter")
    for name in ("RetryTransport", "AsyncRetryTransport", "retrying_client"):
        with pytest.raises(ImproperlyConfigured, match=f"{name} needs httpx.*pip install httpx"):
            getattr(module, name)
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_the_module_imports_without_requests(monkeypatch):
    module = load_client(monkeypatch, "requests", "requests.adapters")
    assert hasattr(module, "RetryTransport")
    for name in ("RetryAdapter", "retrying_session"):
        with pytest.raises(ImproperlyConfigured, match=f"{name} needs requests.*install requests"):
            getattr(module, name)


def test_the_module_needs_tenacity(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match=r'pip install "django-idempotency\[client\]"'):
        load_client(monkeypatch, "tenacity")


# --- metrics and spans ------------------------------------------------------------------------


@pytest.mark.django_db  # a scrape reads the backlog gauges too
@pytest.mark.parametrize("kind", KINDS)
def test_each_retry_is_counted_and_its_delay_measured(kind, server, fake):
    from prometheus_client import REGISTRY  # noqa: PLC0415 - the metrics extra

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    delays = sample("django_idempotency_retry_delay_seconds_count", component="client")
    under = sample("django_idempotency_retry_delay_seconds_bucket", component="client", le="0.1")
    retries = sample(
        "django_idempotency_client_retries_total", host=server.host, reason="status 503"
    )
    server.script.extend([answer(503), answer(503)])

    call(kind, make_policy(fake), "GET", server.url())

    # Two retries, 0.05 s and 0.1 s away.
    assert sample("django_idempotency_retry_delay_seconds_count", component="client") == delays + 2
    assert (
        sample("django_idempotency_retry_delay_seconds_bucket", component="client", le="0.1")
        == under + 2
    )
    assert (
        sample("django_idempotency_client_retries_total", host=server.host, reason="status 503")
        == retries + 2
    )


@pytest.mark.parametrize("kind", KINDS)
def test_each_retry_is_an_event_on_the_callers_span(kind, server, fake):
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415 - the tracing extra
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: PLC0415
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: PLC0415
        InMemorySpanExporter,
    )

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server.script.extend([answer(503), answer(429, {"Retry-After": "2"})])

    with provider.get_tracer("tests").start_as_current_span("charge"):
        call(kind, make_policy(fake), "POST", server.url())

    (span,) = exporter.get_finished_spans()
    assert [event.name for event in span.events] == ["idempotency.retry"] * 2
    assert [dict(event.attributes) for event in span.events] == [
        {
            "idempotency.retry.component": "client",
            "idempotency.retry.attempt": 1,
            "idempotency.retry.delay_ms": 50.0,
            "idempotency.retry.reason": "status 503",
            "server.address": server.host,
        },
        {
            "idempotency.retry.component": "client",
            "idempotency.retry.attempt": 2,
            "idempotency.retry.delay_ms": 2000.0,
            "idempotency.retry.reason": "status 429",
            "server.address": server.host,
        },
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_the_current_correlation_id_goes_to_the_service_below(kind, server, fake):
    from django_idempotency.correlation import bind  # noqa: PLC0415

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
