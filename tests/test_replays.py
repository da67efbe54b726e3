"""Replay counts: a replay writes nothing; its count reaches the key row within about a second."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
from django.db import DatabaseError, connections, transaction
from django.db.backends.signals import connection_created
from django.utils import timezone

from django_idempotency.core.counting import DeferredCounts
from django_idempotency.core.rows import Claim, NewKey, StoredResponse
from django_idempotency.core.store import key_store, replay_counts
from django_idempotency.models import IdempotencyKey
from tests.conftest import in_memory_sqlite
from tests.factories import IdempotencyKeyFactory
from tests.test_store import in_threads

pytestmark = pytest.mark.django_db(transaction=True)


def new_key(now, key="k", fingerprint="f" * 64):
    return NewKey(
        scope="s", key=key, method="POST", route="r/", fingerprint=fingerprint,
        now=now, expires_at=now + timedelta(hours=1), wait_timeout=1,
    )  # fmt: skip


def completed(now, key="k"):
    store = key_store(IdempotencyKey, "default")
    with transaction.atomic():
        claim = store.acquire(new_key(now, key))
        assert isinstance(claim, Claim)
        store.complete(claim, status=201, headers=[], body=b"{}", now=now)
    return store


@pytest.fixture(autouse=True)
def no_pending_counts():
    replay_counts.flush()
    yield
    replay_counts.flush()


@pytest.mark.skipif(in_memory_sqlite(), reason="counts are written at once there")
def test_replays_reach_their_row_within_a_second_or_two_without_anyone_asking(client_alice, key):
    for _ in range(3):
        client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    assert IdempotencyKey.objects.get().replay_count == 0
    deadline = time.monotonic() + 10
    while IdempotencyKey.objects.get().replay_count != 2:
        assert time.monotonic() < deadline, "the replay counts were never written"
        time.sleep(0.1)
    assert IdempotencyKey.objects.get().last_replayed_at is not None
    assert replay_counts.pending() == 0


@pytest.mark.skipif(not in_memory_sqlite(), reason="counts wait in memory elsewhere")
def test_on_an_in_memory_sqlite_database_a_replay_is_counted_at_once_in_its_own_thread(
    client_alice, key
):
    # Threads share an in-memory database through SQLite's shared cache, which refuses a second
    # writer at once: a timer thread writing the counts could make other statements fail.
    threads = set(threading.enumerate())
    for _ in range(3):
        client_alice.send("POST", "/payments/", {"amount": 5}, key=key)
    row = IdempotencyKey.objects.get()
    assert (row.replay_count, row.last_replayed_at is not None) == (2, True)
    assert replay_counts.pending() == 0
    assert set(threading.enumerate()) == threads


def test_the_last_replay_time_is_the_latest_one_counted():
    now = timezone.now()
    store = completed(now)
    for seconds in (5, 30, 10):
        with transaction.atomic():
            assert isinstance(
                store.acquire(new_key(now + timedelta(seconds=seconds))), StoredResponse
            )
    replay_counts.flush()
    row = IdempotencyKey.objects.get()
    assert (row.replay_count, row.last_replayed_at) == (3, now + timedelta(seconds=30))


def test_a_count_is_not_given_to_the_request_that_took_the_key_over_since():
    now = timezone.now()
    store = completed(now)
    with transaction.atomic():
        assert isinstance(store.acquire(new_key(now)), StoredResponse)
    later = now + timedelta(hours=2)  # the key expired: a new request takes it over
    with transaction.atomic():
        assert isinstance(store.acquire(new_key(later, fingerprint="e" * 64)), Claim)
    replay_counts.flush()
    row = IdempotencyKey.objects.get()
    assert (row.lease_version, row.replay_count, row.last_replayed_at) == (2, 0, None)


def test_a_mismatch_or_a_running_key_is_not_counted():
    now = timezone.now()
    IdempotencyKeyFactory(
        scope="s", key="running", fingerprint="f" * 64, expires_at=now + timedelta(hours=1)
    )
    store = completed(now)
    with transaction.atomic():
        assert not isinstance(store.acquire(new_key(now, fingerprint="e" * 64)), StoredResponse)
        assert not isinstance(store.acquire(new_key(now, key="running")), StoredResponse)
    assert replay_counts.pending() == 0


@pytest.mark.server_db
def test_replays_counted_in_many_threads_add_up():
    now = timezone.now()
    store = completed(now)

    def replay(_):
        for _ in range(10):
            with transaction.atomic():
                assert isinstance(
                    key_store(IdempotencyKey, "default").acquire(new_key(now)), StoredResponse
                )

    in_threads(4, replay)
    replay_counts.flush()
    assert IdempotencyKey.objects.get().replay_count == 40
    assert store.using == "default"


def test_counts_that_cannot_be_written_are_dropped_and_logged(caplog):
    def broken(model, using, counts):
        raise DatabaseError("down")

    counts = DeferredCounts(broken, delay=60)
    with caplog.at_level(logging.WARNING, logger="django_idempotency"):
        counts.add(
            IdempotencyKey, "default", 1, 1, timezone.now()
        )  # written at once on in-memory SQLite
        assert counts.flush() == 0
    assert "could not write the deferred counts of 1 rows" in caplog.text
    assert counts.pending() == 0


@pytest.mark.server_db
def test_the_writer_keeps_one_connection_while_counts_keep_coming_and_closes_it_when_idle():
    """Under CONN_MAX_AGE = 0 each request's connection closes with it: the counts of a steady
    stream of replays are written on one connection of the writer's, not one a second."""
    writes, opened = [], []

    def write(model, using, counts):
        with connections[using].cursor() as cursor:  # the writer thread's own connection
            cursor.execute("SELECT 1")
        writes.append(connections[using])
        if len(writes) == 2:
            raise DatabaseError("lost")  # the next write opens a new connection

    def count(sender, connection, **kwargs):
        if threading.current_thread() is not test_thread:
            opened.append(connection)

    test_thread = threading.current_thread()
    counts = DeferredCounts(write, delay=0.3)
    connection_created.connect(count)
    try:
        for row in range(40):  # about 6 writes, 0.3 s apart
            counts.add(IdempotencyKey, "default", row, 1, timezone.now())
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while counts.pending() or writes[-1].connection is not None:
            assert time.monotonic() < deadline, "the writer kept its connection while idle"
            time.sleep(0.05)
    finally:
        connection_created.disconnect(count)
    # The first write's connection served the second; the failed write's was closed, and the
    # writes after it shared a new one; idle, the writer holds none.
    assert len(opened) == 2
    assert len(writes) >= 4
    assert all(wrapper.connection is None for wrapper in writes)


@pytest.mark.server_db
def test_discarding_the_counts_closes_the_writers_connection_at_once():
    """So a test suite that discards them can drop its database right after."""
    writes = []

    def write(model, using, counts):
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT 1")
        writes.append(connections[using])

    counts = DeferredCounts(write, delay=1)  # written after a second, kept a second more
    counts.add(IdempotencyKey, "default", 1, 1, timezone.now())
    deadline = time.monotonic() + 10
    while not writes:
        assert time.monotonic() < deadline, "the count was never written"
        time.sleep(0.01)
    counts.discard()
    assert writes[0].connection is None
