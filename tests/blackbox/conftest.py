"""Fixtures of the fault tests: the served project's database (PostgreSQL, or a SQLite file), the
server (gunicorn, or an ASGI server), a Redis.

Each test starts the servers it needs, with its own knobs, on a database emptied for it; they
are stopped when it ends, and their logs are shown with its failure. ASGI servers may instead be
shared by a module's tests (``share_asgi``): starting one takes longer than most tests.
"""

from __future__ import annotations

import os
from importlib.util import find_spec

import pytest

from tests.blackbox.harness import (
    ASGI_SERVERS,
    Database,
    Redis,
    Server,
    SQLiteDatabase,
    environment,
)

LOGS = pytest.StashKey[list]()


def needs_gunicorn() -> None:
    if find_spec("gunicorn") is None:
        pytest.fail("the fault tests serve the example project with gunicorn: install it")


def needs_uvicorn() -> None:
    if find_spec("uvicorn") is None:
        pytest.fail("the ASGI fault tests serve the example project with uvicorn: install it")


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


def _servers(database, request, tmp_path, *, asgi: bool = False):
    """Start the example project on ``database``, with environment knobs: under gunicorn, or
    with ``asgi`` under the ASGI server of the name given (one of ``ASGI_SERVERS``)."""
    started = []

    def launch(kind: type[Server], name: str, knobs: dict[str, str]) -> Server:
        server = kind(environment(database, **knobs), tmp_path / f"{name}-{len(started)}.log")
        started.append(server)
        request.node.stash.setdefault(LOGS, []).append(server)
        server.wait_until_up()
        return server

    def start(**knobs: str) -> Server:
        return launch(Server, "gunicorn", knobs)

    def start_asgi(name: str, **knobs: str) -> Server:
        return launch(ASGI_SERVERS[name], name, knobs)

    yield start_asgi if asgi else start
    for server in started:
        server.stop()


@pytest.fixture
def serve(database, request, tmp_path):
    """Start the example project under gunicorn, with environment knobs; return the server."""
    yield from _servers(database, request, tmp_path)


@pytest.fixture
def serve_asgi(database, request, tmp_path):
    """Start the example project's ASGI application under the server of that name
    (``ASGI_SERVERS``), with environment knobs: ``serve_asgi("uvicorn", EXAMPLE_...="1")``."""
    needs_uvicorn()
    yield from _servers(database, request, tmp_path, asgi=True)


@pytest.fixture(scope="module")
def asgi_servers(example_database, tmp_path_factory):
    """The ASGI servers a module's tests share: one per server name and knobs, started once."""
    needs_uvicorn()
    started: dict[tuple[str, tuple[tuple[str, str], ...]], Server] = {}
    logs = tmp_path_factory.mktemp("asgi")

    def get(name: str, **knobs: str) -> Server:
        ident = (name, tuple(sorted(knobs.items())))
        if ident not in started:
            log = logs / f"{name}-{len(started)}.log"
            started[ident] = ASGI_SERVERS[name](environment(example_database, **knobs), log)
        return started[ident]

    yield get
    for server in started.values():
        server.stop()


@pytest.fixture
def share_asgi(asgi_servers, database, request):
    """As ``serve_asgi``, but the server is the module's, shared with its other tests that ask
    for the same name and knobs; each test still gets a database emptied for it."""

    def get(name: str, **knobs: str) -> Server:
        server = asgi_servers(name, **knobs)
        request.node.stash.setdefault(LOGS, []).append(server)
        server.wait_until_up()  # a worker killed by an earlier test may still be restarting
        return server

    return get


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
