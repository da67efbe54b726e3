"""The retry-amplification guard: Do-Not-Retry and Request-Timeout-Ms, in and out."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from django.core.servers.basehttp import ThreadedWSGIServer, WSGIRequestHandler
from django.core.wsgi import get_wsgi_application
from django.test import AsyncClient, override_settings

from django_idempotency import guard
from django_idempotency.client import RetryPolicy, retrying_client
from tests.client.helpers import FakeTime, FlakyServer, answer

GUARDED = override_settings(
    MIDDLEWARE=["django_idempotency.guard.RetryGuardMiddleware"],
    ALLOWED_HOSTS=["*"],
)


@pytest.fixture
def downstream():
    """Service B: a loopback server that fails (503) until told otherwise, and records calls."""
    httpd = FlakyServer(FakeTime())
    httpd.script.extend(answer(503) for _ in range(100))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01})
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture
def service():
    """Service A: this Django project, with the guard's middleware, served on loopback."""
    with GUARDED:
        application = get_wsgi_application()
        httpd = ThreadedWSGIServer(("127.0.0.1", 0), QuietHandler)
        httpd.set_app(application)
        thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01})
        thread.start()
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def outer_policy(**overrides):
    return RetryPolicy(
        **{"max_attempts": 3, "base_delay": 0.0, "max_delay": 0.0, "budget": None, **overrides}
    )


# --- end to end: client -> service A (Django) -> service B --------------------------------------


def test_only_the_outermost_layer_retries(service, downstream):
    with retrying_client(outer_policy()) as http:
        response = http.get(f"{service}/relay/", headers={"X-Downstream": downstream.url()})

    assert response.status_code == 503
    # 3 attempts at A, and A calls B once per attempt: 3 calls, not 3 x 3 = 9.
    assert len(downstream.seen) == 3
    assert {seen.headers["do-not-retry"] for seen in downstream.seen} == {"1"}


def test_without_the_signal_every_layer_retries(service, downstream):
    # The amplification the guard prevents: a client that does not propagate.
    with retrying_client(outer_policy(propagate=False)) as http:
        response = http.get(f"{service}/relay/", headers={"X-Downstream": downstream.url()})

    assert response.status_code == 503
    assert len(downstream.seen) == 9


def test_the_deadline_shrinks_at_each_layer(service, downstream):
    downstream.script.clear()  # B answers at once
    with retrying_client(outer_policy(deadline=5.0)) as http:
        response = http.get(f"{service}/relay/", headers={"X-Downstream": downstream.url()})

    assert response.status_code == 200
    (call,) = downstream.seen
    # The client gave A 5 s; A passed on what was left when it called B, a little less.
    assert 0 < int(call.headers["request-timeout-ms"]) < 5000


def test_a_layer_never_waits_past_its_callers_deadline(service):
    slow = FlakyServer(FakeTime())
    slow.script.append(lambda handler: slow.release.wait(10))  # B never answers in time
    thread = threading.Thread(target=slow.serve_forever, kwargs={"poll_interval": 0.01})
    thread.start()
    try:
        with httpx.Client(timeout=30) as http:
            response = http.get(
                f"{service}/relay/",
                headers={"X-Downstream": slow.url(), "Request-Timeout-Ms": "300"},
            )
    finally:
        slow.release.set()
        slow.shutdown()
        slow.server_close()
        thread.join()
    # A's call to B was cut at A's caller's deadline (its own timeout would have waited 5 s),
    # and was not retried: A's caller has given up by then.
    assert response.status_code == 500
    assert len(slow.seen) == 1


# --- the middleware ----------------------------------------------------------------------------


@GUARDED
def test_the_middleware_exposes_the_callers_deadline_and_signal(client):
    plain = client.get("/guard/").json()
    assert plain == {"remaining": None, "retries_allowed": True}

    guarded = client.get(
        "/guard/", headers={"Request-Timeout-Ms": "2000", "Do-Not-Retry": "1"}
    ).json()
    assert 1.5 < guarded["remaining"] <= 2.0
    assert guarded["retries_allowed"] is False


@GUARDED
def test_the_middleware_works_for_async_views():
    async def main():
        return await AsyncClient().get(
            "/guard/async/", headers={"Request-Timeout-Ms": "2000", "Do-Not-Retry": "1"}
        )

    body = asyncio.run(main()).json()
    assert 1.5 < body["remaining"] <= 2.0
    assert body["retries_allowed"] is False


@pytest.mark.parametrize(
    ("headers", "remaining", "allowed"),
    [
        ({}, None, True),
        ({"Request-Timeout-Ms": "1500"}, 1.5, True),
        ({"Request-Timeout-Ms": "0"}, 0.0, True),
        ({"Request-Timeout-Ms": "-5"}, None, True),
        ({"Request-Timeout-Ms": "1.5"}, None, True),
        ({"Request-Timeout-Ms": "soon"}, None, True),
        ({"Request-Timeout-Ms": "٣"}, None, True),  # an Arabic-Indic digit is not ASCII
        ({"Request-Timeout-Ms": str(10**30)}, 86_400.0, True),
        ({"X-Request-Timeout": "2"}, 2.0, True),  # seconds
        ({"X-Request-Timeout": "0.25"}, 0.25, True),
        ({"X-Request-Timeout": "2", "Request-Timeout-Ms": "500"}, 0.5, True),  # the precise one
        ({"X-Request-Timeout": "-1"}, None, True),
        ({"X-Request-Timeout": "nan"}, None, True),
        ({"X-Request-Timeout": "1e9"}, None, True),
        ({"X-Request-Timeout": str(10**30)}, 86_400.0, True),
        ({"Do-Not-Retry": "1"}, None, False),
        ({"Do-Not-Retry": "true"}, None, False),
        ({"Do-Not-Retry": "True"}, None, False),
        ({"Do-Not-Retry": "0"}, None, True),
    ],
)
def test_headers_are_read_strictly_and_malformed_ones_ignored(headers, remaining, allowed):
    inbound = guard.from_headers(headers, now=100.0)
    assert inbound.remaining(now=100.0) == remaining
    assert inbound.retries_allowed is allowed


def test_outside_a_request_there_is_no_limit():
    assert guard.current() == guard.Inbound()
    assert guard.remaining() is None
    assert guard.retries_allowed() is True


# --- the client inside a guarded request ---------------------------------------------------------


def test_the_client_sends_once_when_its_caller_retries(downstream):
    with (
        guard.inbound(guard.Inbound(retries_allowed=False)),
        retrying_client(outer_policy()) as http,
    ):
        assert http.get(downstream.url()).status_code == 503
    assert len(downstream.seen) == 1
    assert downstream.seen[0].headers["do-not-retry"] == "1"


def test_the_client_says_do_not_retry_only_when_it_retries(downstream):
    downstream.script.clear()
    with retrying_client(outer_policy(max_attempts=1)) as http:
        http.post(downstream.url(), content=b"{}")  # one attempt: the server may retry below it
    with retrying_client(outer_policy()) as http:
        http.get(downstream.url())
    first, second = downstream.seen
    assert "do-not-retry" not in first.headers
    assert second.headers["do-not-retry"] == "1"


def test_the_client_stops_retrying_at_its_callers_deadline(downstream):
    fake = FakeTime()
    policy = outer_policy(
        max_attempts=10,
        base_delay=1.0,
        max_delay=1.0,
        random=lambda: 1.0,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    # Its own deadline (30 s) would allow all 10 attempts; the caller waits 2.5 s more.
    caller = guard.Inbound(deadline=time.monotonic() + 2.5)
    with guard.inbound(caller), retrying_client(policy) as http:
        assert http.get(downstream.url()).status_code == 503
    assert fake.sleeps == [1.0, 1.0]
    sent = [int(seen.headers["request-timeout-ms"]) for seen in downstream.seen]
    assert len(sent) == 3
    assert sent[0] <= 2500
    assert sent[0] - sent[1] == pytest.approx(1000, abs=50)
