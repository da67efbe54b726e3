"""Fixtures of the fault tests: the served project's database (PostgreSQL, or a SQLite file), the
server, a Redis.

Each test starts the servers it needs, with its own knobs, on a database emptied for it; they
are stopped when it ends, and their logs are shown with its failure.
"""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest

from tests.blackbox.harness import Database, Redis, Server, SQLiteDatabase, environment

LOGS = pytest.StashKey[list]()


def needs_gunicorn() -> None:
    if find_spec("gunicorn") is None:
        pytest.fail("the fault tests serve the example project with gunicorn: install it")


@pytest.fixture(scope="session")
def example_database():
    needs_gunicorn()
    database = Database(os.environ.get("TEST_PG_NAME", "django_idempotency") + "_blackbox")
    database.create(environment(database))
    yield database
    database.drop()


@pytest.fixture
def database(example_database):
    example_database.empty()
    return example_database


@pytest.fixture(scope="session")
def example_sqlite_database(tmp_path_factory):
    needs_gunicorn()
    database = SQLiteDatabase(tmp_path_factory.mktemp("sqlite") / "example.sqlite3")
    database.create(environment(database))
    yield database
    database.drop()


@pytest.fixture
def sqlite_database(example_sqlite_database):
    example_sqlite_database.empty()
    return example_sqlite_database


def _servers(database, request, tmp_path):
    """Start the example project under gunicorn on ``database``, with environment knobs."""
    started = []

    def start(**knobs: str) -> Server:
        server = Server(environment(database, **knobs), tmp_path / f"gunicorn-{len(started)}.log")
        started.append(server)
        request.node.stash.setdefault(LOGS, []).append(server)
        server.wait_until_up()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def serve(database, request, tmp_path):
    """Start the example project under gunicorn, with environment knobs; return the server."""
    yield from _servers(database, request, tmp_path)


@pytest.fixture
def serve_sqlite(sqlite_database, request, tmp_path):
    """As ``serve``, on a SQLite file of the session's own."""
    yield from _servers(sqlite_database, request, tmp_path)


@pytest.fixture
def redis_server(request, tmp_path):
    redis = Redis(tmp_path / "redis.log")
    request.node.stash.setdefault(LOGS, []).append(redis)
    try:
        redis.wait_until_up()
        yield redis
    finally:
        redis.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for process in item.stash.get(LOGS, []):
            report.sections.append((f"log of {process.log_path.name}", process.log()))
    return report
