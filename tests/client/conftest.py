"""Fixtures of the retrying client's tests: a fake clock, and a loopback server on it."""

from __future__ import annotations

import threading

import pytest

from tests.client.helpers import FakeTime, FlakyServer


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
