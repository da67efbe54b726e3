"""The replay cache on a real Redis, through Django's own backend and django-redis: an
accelerator that is never the arbiter."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from datetime import timedelta

import pytest
from django.core.cache import caches
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.core import cache as replay_cache_module
from django_idempotency.core.engine import default_engine
from django_idempotency.core.store import replay_counts
from django_idempotency.models import IdempotencyKey
from tests.conftest import ApiClient
from tests.testapp.models import LedgerEntry, Payment

# The timeouts the documented configuration sets, in seconds.
TIMEOUT = 0.5


def redis_cache(backend: str, location: str) -> dict:
    """A cache on Redis with the documented timeouts, through either backend."""
    if backend == "django-redis":
        options = {"SOCKET_TIMEOUT": TIMEOUT, "SOCKET_CONNECT_TIMEOUT": TIMEOUT}
        return {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": location,
            "OPTIONS": options,
        }
    options = {"socket_timeout": TIMEOUT, "socket_connect_timeout": TIMEOUT}
    return {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": location,
        "OPTIONS": options,
    }


def caches_setting(backend: str, **more: dict) -> dict:
    return {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "replay": redis_cache(
            backend, f"redis://127.0.0.1:6379/{os.environ.get('TEST_REDIS_CACHE_DB', '15')}"
        ),
        "down": redis_cache(backend, "redis://127.0.0.1:1/0"),
        **more,
    }


pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]


# Every test runs on Django's own Redis backend and on django-redis.
@pytest.fixture(params=["django", "django-redis"])
def backend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def replay_cache(backend):
    with override_settings(CACHES=caches_setting(backend), IDEMPOTENCY={"CACHE": "replay"}):
        caches["replay"].clear()
        yield caches["replay"]
        caches["replay"].clear()


def key_table_queries(captured) -> list[str]:
    return [q["sql"] for q in captured if IdempotencyKey._meta.db_table in q["sql"]]


def test_a_replay_is_served_from_the_cache_without_the_database(client_alice, key):
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    second = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)  # fills the cache
    with CaptureQueriesContext(connection) as captured:
        third = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert second["Idempotency-Status"] == third["Idempotency-Status"] == "replayed"
    assert second.content == third.content == first.content
    assert third["Location"] == first["Location"]
    assert key_table_queries(captured) == []
    assert Payment.objects.count() == 1


def test_a_fresh_request_does_not_write_the_cache(client_alice, key, replay_cache):
    # Most keys are never replayed: the first replay fills the cache, not the first request.
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    row = IdempotencyKey.objects.get()
    cache = replay_cache_module.ReplayCache("replay")
    look = {"scope": row.scope, "key": key, "fingerprint": row.fingerprint, "now": timezone.now()}
    assert cache.get(**look) is None
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert cache.get(**look) is not None


def test_a_flushed_cache_falls_back_to_the_database_and_refills(client_alice, key, replay_cache):
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)  # fills the cache
    replay_cache.clear()
    second = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    with CaptureQueriesContext(connection) as captured:
        third = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert second.content == third.content == first.content
    assert second["Idempotency-Status"] == third["Idempotency-Status"] == "replayed"
    assert key_table_queries(captured) == []  # refilled by the database replay
    replay_counts.flush()
    assert IdempotencyKey.objects.get().replay_count == 2  # only the database replays counted


@override_settings(IDEMPOTENCY={"CACHE": "down"})
def test_a_cache_that_is_down_costs_speed_never_an_error(client_alice, key, caplog):
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    second = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert first["Idempotency-Status"] == "stored"
    assert second["Idempotency-Status"] == "replayed"
    assert "replay cache unavailable" in caplog.text
    assert Payment.objects.count() == 1


def test_a_different_request_is_judged_by_the_database(client_alice, key):
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert client_alice.send("POST", "/payments/", {"amount": 6}, key=key).status_code == 422


def test_an_expired_key_is_not_served_from_the_cache(client_alice, key, monkeypatch):
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    later = timezone.now() + timedelta(hours=25)
    monkeypatch.setattr(default_engine, "clock", lambda: later)
    again = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert again["Idempotency-Status"] == "stored"
    assert Payment.objects.count() == 2


def test_a_response_that_is_rolled_back_is_never_cached(client_alice, key, replay_cache):
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key, headers={"X-Status": "503"})
    retry = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert retry["Idempotency-Status"] == "stored"
    assert (Payment.objects.count(), LedgerEntry.objects.count()) == (1, 1)


@pytest.mark.server_db
def test_concurrent_duplicates_with_a_cache_flushed_meanwhile_make_one_payment(
    alice, key, replay_cache
):
    from tests.test_store import in_threads  # noqa: PLC0415

    def post(index):
        if index == 10:
            replay_cache.clear()
        return ApiClient(alice).send(
            "POST", "/payments/", {"amount": 9}, key=key, headers={"X-Hold": "0.2"}
        )

    responses = in_threads(20, post)
    assert Payment.objects.count() == 1
    assert all(response.status_code in (201, 409) for response in responses)
    assert len({r.content for r in responses if r.status_code == 201}) == 1


@pytest.fixture
def own_redis(backend):
    """A redis-server of this test's own, on a free loopback port, that the test may freeze."""
    if (executable := shutil.which("redis-server")) is None:
        pytest.skip("needs redis-server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            executable,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as ping:
                ping.sendall(b"PING\r\n")
                if ping.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)
    own = redis_cache(backend, f"redis://127.0.0.1:{port}/0")
    try:
        with override_settings(
            CACHES=caches_setting(backend, own=own), IDEMPOTENCY={"CACHE": "own"}
        ):
            yield server
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
            server.kill()
        server.wait()


def timed(send):
    started = time.monotonic()
    response = send()
    return response, time.monotonic() - started


def bypass_records(caplog):
    return [r for r in caplog.records if "bypassing it" in r.getMessage()]


# Room for a loaded test machine on top of the timeouts a request may wait for: eight threads
# of one process on two busy cores took 2.1 s for a request that waits at most 1 s. Still far
# below a frozen Redis's wait with no timeout (for ever), and which replays met the frozen cache
# at all is counted, not timed.
SLACK = 2.5


def report(keep_times, backend, what, seconds):
    """Keep the measured request times in the test's output (pytest -rP) and properties."""
    print(f"{what}, {backend}: " + ", ".join(f"{took:.3f}" for took in seconds) + " s")
    keep_times(what, [round(took, 3) for took in seconds])


@pytest.fixture
def keep_times(request):
    # Not pytest's record_property: it warns under runtests.py's --junitxml (xunit2 has no
    # properties). The times stay on the test item, where a plugin or -rP finds them.
    def record(name, value):
        request.node.user_properties.append((name, value))

    return record


def test_a_frozen_cache_is_bypassed_after_a_few_timeouts_and_answers_stay_right(
    client_alice, own_redis, caplog, backend, keep_times
):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    stored = {}
    for _ in range(4):
        key = str(uuid.uuid4())
        stored[key] = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
        client_alice.send("POST", "/payments/", {"amount": 5}, key=key)  # fills the cache
    with CaptureQueriesContext(connection) as captured:
        warm = [client_alice.send("POST", "/payments/", {"amount": 5}, key=k) for k in stored]
    assert key_table_queries(captured) == []  # the replays came from the cache
    assert all(r["Idempotency-Status"] == "replayed" for r in warm)

    os.kill(own_redis.pid, signal.SIGSTOP)  # Redis stops answering, its socket stays open
    answers = []
    for _ in range(3):
        for key, first in stored.items():
            response, took = timed(
                lambda key=key: client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
            )
            assert response.status_code == 201
            assert response["Idempotency-Status"] == "replayed"
            assert response.content == first.content
            answers.append(took)
        fresh = str(uuid.uuid4())
        for expected in ("stored", "replayed"):
            response, took = timed(
                lambda fresh=fresh: client_alice.send(
                    "POST", "/payments/", {"amount": 5}, key=fresh
                )
            )
            assert response["Idempotency-Status"] == expected
            answers.append(took)

    # One effect per key, whatever the cache did.
    assert Payment.objects.count() == len(stored) + 3
    # Three failures in a row trip the breaker: the first replay's read and refill, then the
    # second's read. Each waited for the socket timeout, no longer.
    tripping, after = answers[:2], answers[2:]
    report(keep_times, backend, "frozen Redis: the 2 requests that trip it", tripping)
    report(keep_times, backend, "frozen Redis: the longest of the others", [max(after)])
    assert TIMEOUT * 0.9 <= tripping[0] <= 2 * TIMEOUT + SLACK
    assert TIMEOUT * 0.9 <= tripping[1] <= TIMEOUT + SLACK
    # Then no request tries the frozen cache any more, so none pays the timeout: the three
    # failures that tripped the breaker are all the cache's failures.
    failures = [r for r in caplog.records if r.getMessage().startswith("replay cache unavailable")]
    assert len(failures) == 3, [r.getMessage() for r in failures]
    assert max(after) < TIMEOUT, after  # a request that waited for the socket took longer
    assert len(bypass_records(caplog)) == 1
    assert bypass_records(caplog)[0].levelno == logging.WARNING


def test_a_killed_cache_costs_no_wait_and_answers_stay_right(
    client_alice, own_redis, caplog, backend, keep_times
):
    stored = {}
    for _ in range(2):
        key = str(uuid.uuid4())
        stored[key] = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)

    own_redis.kill()  # Redis is gone: its port refuses connections
    own_redis.wait()
    answers = []
    for _ in range(2):
        for key, first in stored.items():
            response, took = timed(
                lambda key=key: client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
            )
            assert response["Idempotency-Status"] == "replayed"
            assert response.content == first.content
            answers.append(took)
    fresh = str(uuid.uuid4())
    for expected in ("stored", "replayed"):
        response, took = timed(
            lambda: client_alice.send("POST", "/payments/", {"amount": 5}, key=fresh)
        )
        assert response["Idempotency-Status"] == expected
        answers.append(took)

    assert Payment.objects.count() == len(stored) + 1
    assert "replay cache unavailable" in caplog.text
    assert len(bypass_records(caplog)) == 1
    report(keep_times, backend, "killed Redis: each request", answers)
    # A refused connection fails at once: no request waits for a timeout.
    assert max(answers) < TIMEOUT, answers


def test_the_bypass_ends_once_the_cache_answers_again(client_alice, own_redis, caplog, key):
    caplog.set_level(logging.INFO, logger="django_idempotency")
    first = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    os.kill(own_redis.pid, signal.SIGSTOP)
    for _ in range(2):
        client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert len(bypass_records(caplog)) == 1

    os.kill(own_redis.pid, signal.SIGCONT)
    # Still bypassed during the cool-down: the database answers.
    with CaptureQueriesContext(connection) as captured:
        client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert key_table_queries(captured) != []

    breaker = replay_cache_module.breaker_for("own")
    later = time.monotonic() + breaker.cool_down + 1
    breaker.clock = lambda: later
    # The first call after the cool-down tries the cache, finds it answering, and closes the
    # breaker: this replay refills the cache, and the next is served from it.
    client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    with CaptureQueriesContext(connection) as captured:
        again = client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert key_table_queries(captured) == []
    assert again.content == first.content
    assert "replay cache 'own' answers again" in caplog.text
    assert Payment.objects.count() == 1


@pytest.mark.server_db
def test_concurrent_requests_trip_the_breaker_once_and_stop_paying_the_timeout(
    alice, own_redis, caplog, backend, keep_times
):
    import threading  # noqa: PLC0415

    from tests.test_store import in_threads  # noqa: PLC0415

    caplog.set_level(logging.INFO, logger="django_idempotency")
    workers = 8
    stored, frozen = threading.Barrier(workers + 1), threading.Barrier(workers + 1)
    # Which replay of which worker each cache call let through to the frozen Redis came from.
    replaying, reached = threading.local(), []
    breaker = replay_cache_module.breaker_for("own")
    allow = breaker.allow

    def counted_allow():
        allowed = allow()
        if allowed and getattr(replaying, "attempt", None) is not None:
            reached.append((replaying.worker, replaying.attempt))
        return allowed

    breaker.allow = counted_allow  # an instance attribute: deleting it restores the method

    def work(index):
        if index == workers:  # freezes Redis once every worker has stored its payment
            stored.wait()
            os.kill(own_redis.pid, signal.SIGSTOP)
            frozen.wait()
            return None
        client, key = ApiClient(alice), str(uuid.uuid4())
        first = client.send("POST", "/payments/", {"amount": 7}, key=key)
        stored.wait()
        frozen.wait()
        answers = []
        replaying.worker = index
        for attempt in range(5):
            replaying.attempt = attempt
            answers.append(timed(lambda: client.send("POST", "/payments/", {"amount": 7}, key=key)))
        assert all(r.content == first.content for r, _ in answers)
        assert all(r["Idempotency-Status"] == "replayed" for r, _ in answers)
        return [took for _, took in answers]

    try:
        durations = in_threads(workers + 1, work)[:workers]
    finally:
        del breaker.allow

    report(keep_times, backend, "frozen Redis, 8 at once: first", [t[0] for t in durations])
    report(
        keep_times,
        backend,
        "frozen Redis, 8 at once: longest of the others",
        [max(t[1:]) for t in durations],
    )
    assert Payment.objects.count() == workers
    # Each worker's first replay may have met the frozen cache (its read, and its refill if the
    # breaker had not tripped yet); none after that, so none of them paid the timeout again.
    assert reached, "no replay tried the frozen cache"
    assert {attempt for _, attempt in reached} == {0}, reached
    assert all(took[0] <= 2 * TIMEOUT + SLACK for took in durations), durations
    assert len(bypass_records(caplog)) == 1
