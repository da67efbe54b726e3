from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.test.client import FakePayload

from tests.factories import UserFactory

POSTGRESQL = os.environ.get("TEST_DATABASE") == "postgresql"
MARIADB = os.environ.get("TEST_DATABASE") == "mariadb"
CI = os.environ.get("CI", "").lower() == "true"
# The psycopg2 pass (runtests.py) hides psycopg 3, here and in the processes the tests start.
PSYCOPG2 = os.environ.get("TEST_PG_DRIVER") == "psycopg2"
# runtests.py's PgBouncer pass: the tests connect through a pooler in transaction mode, and the
# "direct" alias to the server itself (tests/settings.py).
BEHIND_PGBOUNCER = POSTGRESQL and bool(os.environ.get("TEST_PGBOUNCER_PORT"))


def process_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, on the same test database."""
    name = {"postgresql": "TEST_PG_NAME", "mysql": "TEST_MARIADB_NAME"}[connection.vendor]
    return {**os.environ, name: connection.settings_dict["NAME"], **extra}


def start_command(*args: str) -> subprocess.Popen[str]:
    """Start ``manage.py <args>`` in a process of its own, on the test database, with its output
    piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "django", *args],
        cwd=Path(__file__).resolve().parent.parent,
        env=process_env(DJANGO_SETTINGS_MODULE="tests.settings"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stop_commands(
    processes: list[subprocess.Popen[str]], timeout: float = 30
) -> tuple[list[int], list[tuple[str, str]]]:
    """Stop the commands with SIGTERM, as a supervisor does; return their exit codes and
    outputs."""
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
    outputs = [process.communicate(timeout=timeout) for process in processes]
    return [process.returncode for process in processes], outputs


def in_memory_sqlite() -> bool:
    """Whether the tests run on an in-memory SQLite database, where counts are written at once."""
    return connection.vendor == "sqlite" and connection.is_in_memory_db()


def redis_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1):
            return True
    except OSError:
        return False


# runtests.py runs the tests that touch no database in its first pass alone.
DATABASE_BOUND_ONLY = os.environ.get("TEST_DATABASE_BOUND_ONLY") == "1"
# What a test that touches a database asks for: pytest-django refuses every query to the others.
# The docs' sample tests run in a pytest process of their own, on the pass's database.
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "sample_test_results",
    }
)
DATABASE_MARKERS = frozenset({"django_db", "server_db", "postgresql", "sqlite", "pgbouncer"})


def touches_a_database(item) -> bool:
    return bool(
        DATABASE_MARKERS.intersection(item.keywords)
        or DATABASE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    )


def pytest_collection_modifyitems(config, items):
    if DATABASE_BOUND_ONLY:
        free = [item for item in items if not touches_a_database(item)]
        if free:
            config.hook.pytest_deselected(items=free)
            items[:] = [item for item in items if touches_a_database(item)]
    # Tests of races need a database server: runtests.py runs the suite on SQLite, PostgreSQL
    # and MariaDB. A few look at what only PostgreSQL has.
    skip_server_db = pytest.mark.skip(reason="needs TEST_DATABASE=postgresql or mariadb")
    skip_postgresql = pytest.mark.skip(reason="needs PostgreSQL: TEST_DATABASE=postgresql")
    # Tests on SQLite files of their own mean the same on every pass: they run in SQLite's.
    skip_sqlite = pytest.mark.skip(reason="runs in the SQLite pass (TEST_DATABASE unset)")
    skip_pgbouncer = pytest.mark.skip(reason="needs PgBouncer: runtests.py --databases pgbouncer")
    # Redis tests need a Redis on 127.0.0.1:6379; in CI a missing one is a failure.
    skip_redis = None if CI or redis_reachable() else pytest.mark.skip(reason="needs Redis")
    for item in items:
        if "server_db" in item.keywords and not (POSTGRESQL or MARIADB):
            item.add_marker(skip_server_db)
        if "postgresql" in item.keywords and not POSTGRESQL:
            item.add_marker(skip_postgresql)
        if "sqlite" in item.keywords and (POSTGRESQL or MARIADB):
            item.add_marker(skip_sqlite)
        if "pgbouncer" in item.keywords and not BEHIND_PGBOUNCER:
            item.add_marker(skip_pgbouncer)
        if "redis" in item.keywords and skip_redis is not None:
            item.add_marker(skip_redis)


def basic_auth(user) -> str:
    token = base64.b64encode(f"{user.username}:password".encode()).decode()
    return f"Basic {token}"


class ApiClient(Client):
    """A test client that speaks JSON as ``user`` and can send an idempotency key."""

    def __init__(self, user=None, **defaults):
        super().__init__(**defaults)
        self.user = user

    def send(self, method, path, data=None, *, key=None, content_type="application/json", **extra):
        headers = dict(extra.pop("headers", {}))
        if self.user is not None:
            headers["Authorization"] = basic_auth(self.user)
        if key is not None:
            headers["Idempotency-Key"] = key
        body = data if isinstance(data, str | bytes) or data is None else _json(data)
        return self.generic(
            method, path, body or "", content_type=content_type, headers=headers, **extra
        )


def send_chunked(client, method, path, body: bytes, *, content_type="application/json", headers=()):
    """Send ``body`` as a WSGI server hands Django a chunked request: the decoded body in
    ``wsgi.input``, ``Transfer-Encoding`` set, and no ``CONTENT_LENGTH`` (which the test client
    otherwise always sets)."""
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "CONTENT_TYPE": content_type,
        "HTTP_TRANSFER_ENCODING": "chunked",
        "wsgi.input": FakePayload(body),
    }
    for name, value in dict(headers).items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    return client.request(**environ)


def _json(data) -> str:
    return json.dumps(data)


@pytest.fixture
def alice(db):
    return UserFactory(username="alice")


@pytest.fixture
def bob(db):
    return UserFactory(username="bob")


@pytest.fixture
def client_alice(alice):
    return ApiClient(alice)


@pytest.fixture
def client_bob(bob):
    return ApiClient(bob)


@pytest.fixture
def key():
    return str(uuid.uuid4())


@pytest.fixture
def vendor():
    return connection.vendor


@pytest.fixture(autouse=True)
def unwritten_counts():
    """Each test starts without replay or delivery counts from another, whose rows were rolled
    back."""
    from django_idempotency.core.store import replay_counts  # noqa: PLC0415 - needs the app registry
    from django_idempotency.inbox.receiving import delivery_counts  # noqa: PLC0415

    for counts in (replay_counts, delivery_counts):
        counts.discard()
    yield replay_counts
    for counts in (replay_counts, delivery_counts):
        counts.discard()


@pytest.fixture(scope="session", autouse=True)
def database_features_known(django_db_setup, django_db_blocker):
    """Ask each test database once, at the start, what it supports.

    From Django 6.1 the system checks (which Celery's worker also runs) ask every database
    whether it stores JSON, and a test that may not reach one of them would fail for it.
    """
    from django.db import connections  # noqa: PLC0415

    with django_db_blocker.unblock():
        for alias in connections:
            connections[alias].features.supports_json_field  # noqa: B018 - cached on first read
