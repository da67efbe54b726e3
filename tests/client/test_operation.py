"""One logical request over its attempts (``client._operation``).

What is retried, when the retries stop, the deadline, discarded responses, logs, metrics and spans.
"""

from __future__ import annotations

import logging

import pytest

from tests.client.helpers import (
    KINDS,
    TRANSPORT_ERRORS,
    answer,
    call,
    drop,
    make_policy,
    reset,
    slow,
)

BIG = 100 * 1024  # a body longer than the client drains


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


# --- a Retry-After past max_delay or the deadline ---------------------------------------------


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


# --- discarded responses and logs -------------------------------------------------------------


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
