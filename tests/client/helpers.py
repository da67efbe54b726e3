"""The retrying client's tests: a real loopback server that fails on cue, and a fake clock.

Each test scripts the server's answers (503s, 429s with Retry-After, resets, a slow answer, then
200) and asserts what reached the server. Sleeps go to a fake clock, so no test waits for a
backoff. The fixtures that serve and time them are in this folder's conftest.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import requests

from django_idempotency.client import (
    AsyncRetryTransport,
    CircuitBreakers,
    RetryAdapter,
    RetryBudgets,
    RetryPolicy,
    RetryTransport,
)

KINDS = ["httpx", "async", "requests"]


WALL = 1_700_000_000.0  # the wall clock's fixed "now", for HTTP-date Retry-After values


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
