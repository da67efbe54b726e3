"""The requests adapter and session (``client._requests``)."""

from __future__ import annotations

import pytest
import requests
from requests.adapters import HTTPAdapter

from django_idempotency.client import retrying_session
from tests.client.helpers import answer, make_policy


def test_requests_sends_a_streamed_body_once(server, fake):
    server.script.append(answer(503))

    with retrying_session(make_policy(fake)) as session:
        response = session.put(server.url(), data=iter([b"part one, ", b"part two"]))

    assert response.status_code == 503
    assert [seen.body for seen in server.seen] == [b"part one, part two"]


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
