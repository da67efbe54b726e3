"""The example project served by gunicorn, or by an ASGI server (uvicorn; gunicorn with uvicorn's
workers), on a database of its own (PostgreSQL, or a SQLite file), and what the fault tests need
around it: an HTTP client that can send what well-behaved clients do not, or hang up, the effects
counted in the database, and a Redis to freeze.

Every process started here is stopped by whoever started it; every wait has a bound.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

try:
    import psycopg as driver
    from psycopg import sql
except ImportError:  # the psycopg2 pass hides psycopg 3: the tests and the served project use 2
    import psycopg2 as driver  # type: ignore[no-redef]
    from psycopg2 import sql  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "example_project"
USERNAME, PASSWORD = "alice", "password"
# The secrets the served project verifies webhooks with, and the tests sign them with.
PROVIDER_SECRET = "whsec_fault-tests-only"
PAYMENT_EVENTS_SECRET = "whsec_ZmF1bHQtdGVzdHMtb25seQ=="
PROBLEM = "application/problem+json"
# Bounds: how long a server may take to answer its first request, and a request by default.
START_TIMEOUT = 30.0
REQUEST_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(condition: Any, *, timeout: float, interval: float = 0.02, what: str = "") -> Any:
    """Poll ``condition()`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if result := condition():
            return result
        if time.monotonic() > deadline:
            msg = f"gave up after {timeout} s waiting for {what or condition}"
            raise AssertionError(msg)
        time.sleep(interval)


# -- the database ------------------------------------------------------------------------------


class Database:
    """The served project's PostgreSQL database: created, migrated, counted, dropped."""

    def __init__(self, name: str) -> None:
        self.name = name
        host = os.environ.get("PGHOST", "127.0.0.1")
        port = os.environ.get("PGPORT", "5432")
        user = os.environ.get("PGUSER", "postgres")
        password = os.environ.get("PGPASSWORD", "")
        credentials = f"{user}:{password}" if password else user
        # The tests read, count and terminate on the server itself.
        self.url = f"postgres://{credentials}@{host}:{port}/{name}"
        self.admin_url = f"postgres://{credentials}@{host}:{port}/postgres"
        # The served project connects through the PgBouncer pass's pooler, if there is one.
        self.pgbouncer_port = os.environ.get("TEST_PGBOUNCER_PORT")
        served = f"127.0.0.1:{self.pgbouncer_port}" if self.pgbouncer_port else f"{host}:{port}"
        self.served_url = f"postgres://{credentials}@{served}/{name}"

    @property
    def settings(self) -> dict[str, str]:
        """What tells the served project's settings to use this database."""
        pooled = {"BLACKBOX_BEHIND_PGBOUNCER": "1"} if self.pgbouncer_port else {}
        return {"DATABASE_URL": self.served_url, **pooled}

    def create(self, env: dict[str, str]) -> None:
        """Create the database anew, migrate it and add the user the tests authenticate as."""
        self.drop()
        run_sql(self.admin_url, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        manage(env, "migrate", "--verbosity", "0")
        manage(
            env,
            "shell",
            "--verbosity",
            "0",
            "-c",
            "from django.contrib.auth.models import User; "
            f"User.objects.create_user({USERNAME!r}, password={PASSWORD!r})",
        )

    def drop(self) -> None:
        drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name))
        run_sql(self.admin_url, drop)

    def execute(self, statement: Any, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return run_sql(self.url, statement, params)

    def empty(self) -> None:
        """Delete every payment, key, inbox event and outbox message; keep the user."""
        tables = [
            name
            for (name,) in self.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                "AND (tablename LIKE 'payments\\_%' OR tablename LIKE 'django\\_idempotency\\_%')"
            )
        ]
        self.execute(
            sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
                sql.SQL(", ").join(map(sql.Identifier, tables))
            )
        )

    def count(self, table: str, where: str = "TRUE", params: tuple[Any, ...] = ()) -> int:
        return int(self.execute(f"SELECT count(*) FROM {table} WHERE {where}", params)[0][0])  # noqa: S608 - the tests' own table names

    def effects(self) -> dict[str, int]:
        """Every effect a request can have, counted."""
        return {
            "provider charges": self.count("payments_providercharge"),
            "payments": self.count("payments_payment"),
            "ledger entries": self.count("payments_ledgerentry"),
            "outbox messages": self.count("django_idempotency_outboxmessage"),
            "inbox events": self.count("django_idempotency_inboxevent"),
            "receipts": self.count("payments_receiptemail"),
            "stored keys": self.count("django_idempotency_idempotencykey"),
        }

    def payment_ids(self) -> set[int]:
        return {pk for (pk,) in self.execute("SELECT id FROM payments_payment")}

    def terminate_other_connections(self) -> int:
        """Terminate every other session on this database, as a failover or an operator does."""
        rows = self.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return sum(1 for (terminated,) in rows if terminated)


def run_sql(url: str, statement: Any, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement in a connection of its own, in autocommit mode; return its rows."""
    connection = driver.connect(url)
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute(statement, params or None)
            return cursor.fetchall() if cursor.description else []
    finally:
        connection.close()


class SQLiteDatabase:
    """The served project's SQLite file (and its provider's, if the project has that alias):
    created, migrated, read, emptied."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.aliases: list[str] = []  # the served project's databases, once created

    @property
    def settings(self) -> dict[str, str]:
        """What tells the served project's settings to use this file (see server_settings)."""
        return {"BLACKBOX_SQLITE_PATH": str(self.path)}

    @property
    def files(self) -> list[Path]:
        extra = [Path(f"{self.path}-provider")] if "provider" in self.aliases else []
        return [self.path, *extra]

    def create(self, env: dict[str, str]) -> None:
        """Create the files anew, migrate each database, add the user the tests sign in as."""
        self.drop()
        setup = (
            "from django.conf import settings\n"
            "from django.contrib.auth.models import User\n"
            "from django.core.management import call_command\n"
            "for alias in settings.DATABASES:\n"
            "    call_command('migrate', database=alias, verbosity=0)\n"
            f"User.objects.create_user({USERNAME!r}, password={PASSWORD!r})\n"
            "print(' '.join(settings.DATABASES))\n"
        )
        self.aliases = manage(env, "shell", "--verbosity", "0", "-c", setup).split()

    def drop(self) -> None:
        for path in (self.path, Path(f"{self.path}-provider")):
            for name in (path, Path(f"{path}-journal"), Path(f"{path}-wal"), Path(f"{path}-shm")):
                name.unlink(missing_ok=True)

    def execute(
        self, statement: str, params: tuple[Any, ...] = (), *, path: Path | None = None
    ) -> list[tuple[Any, ...]]:
        connection = sqlite3.connect(path or self.path, timeout=REQUEST_TIMEOUT)
        try:
            with connection:
                return connection.execute(statement, params).fetchall()
        finally:
            connection.close()

    def empty(self) -> None:
        """Delete every payment, key, inbox event and outbox message; keep the user."""
        for path in self.files:
            tables = [
                name
                for (name,) in self.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND "
                    "(name LIKE 'payments\\_%' ESCAPE '\\' "
                    "OR name LIKE 'django\\_idempotency\\_%' ESCAPE '\\')",
                    path=path,
                )
            ]
            for table in tables:
                self.execute(f'DELETE FROM "{table}"', path=path)  # noqa: S608 - the project's own tables
            self.execute(
                f"DELETE FROM sqlite_sequence WHERE name IN ({', '.join('?' * len(tables))})",  # noqa: S608 - placeholders
                tuple(tables),
                path=path,
            )


def environment(database: Database | SQLiteDatabase, **knobs: str) -> dict[str, str]:
    """The served project's environment: the test's database and the given knobs."""
    env = {
        name: value
        for name, value in os.environ.items()
        # The project's own switches: a broker would move the inbox and outbox off the request.
        if name not in {"CELERY_BROKER_URL", "DEBUG", "DATABASE_URL", "PAYMENT_EVENTS_URL"}
        and not name.startswith(("EXAMPLE_", "BLACKBOX_"))
    }
    env.update(
        DJANGO_SETTINGS_MODULE="tests.blackbox.server_settings",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(EXAMPLE)]),
        **database.settings,
        PROVIDER_WEBHOOK_SECRETS=PROVIDER_SECRET,
        PAYMENT_EVENTS_SECRETS=PAYMENT_EVENTS_SECRET,
        PYTHONUNBUFFERED="1",
    )
    env.update(knobs)
    return env


def manage(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """Run the served project's ``manage.py``; return its output."""
    completed = subprocess.run(
        [sys.executable, str(EXAMPLE / "manage.py"), *args],
        env=env,
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if completed.returncode != 0:
        msg = f"manage.py {' '.join(args)} failed:\n{completed.stdout}\n{completed.stderr}"
        raise AssertionError(msg)
    return completed.stdout


# -- HTTP -----------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    seconds: float

    @property
    def content_type(self) -> str:
        return (self.headers.get("Content-Type") or "").split(";")[0].strip()

    def json(self) -> Any:
        return json.loads(self.body)

    def field(self, name: str) -> Any:
        """A field of a JSON object body; ``None`` when there is no such body or field."""
        try:
            data = self.json()
        except ValueError:
            return None
        return data.get(name) if isinstance(data, dict) else None

    def __str__(self) -> str:
        return f"{self.status} {self.content_type} {self.body[:300]!r}"


def basic_auth() -> tuple[str, str]:
    token = base64.b64encode(f"{USERNAME}:{PASSWORD}".encode()).decode()
    return ("Authorization", f"Basic {token}")


# -- processes ------------------------------------------------------------------------------------


class Process:
    """A process started in a session of its own, its output in a file; stopped for sure."""

    def __init__(self, command: list[str], *, env: dict[str, str], log: Path, cwd: Path) -> None:
        self.log_path = log
        with log.open("wb") as output:
            self.popen = subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def stop(self, grace: float = 10.0) -> None:
        """Thaw anything frozen, ask the process to stop, and kill its group past ``grace``."""
        if self.popen.poll() is None:
            self.signal_group(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.popen.wait(timeout=10)
        # Workers left behind by a master that died first.
        self.signal_group(signal.SIGKILL)


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s child processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid:
            found.append(int(entry.name))
    return sorted(found)


class Server(Process):
    """The example project under gunicorn: gthread workers, a timeout that kills no slow request.

    Subclasses serve it otherwise (``command``, ``workers``) with the same API, so that a test
    can be parametrized over them.
    """

    WORKERS, THREADS = 2, 4
    name = "gunicorn (gthread)"

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        # The outbox sends the payment events back to this server's inbox, as to another service,
        # unless the test gives it another address.
        env = {"PAYMENT_EVENTS_URL": f"http://127.0.0.1:{self.port}/webhooks/payments/", **env}
        super().__init__(self.command(), env=env, log=log, cwd=ROOT)
        self.env = env

    def command(self) -> list[str]:
        return [
            *self.gunicorn("example_project.wsgi:application"),
            "--worker-class",
            "gthread",
            "--threads",
            str(self.THREADS),
        ]

    def gunicorn(self, application: str) -> list[str]:
        """gunicorn serving ``application`` on this server's port, with WORKERS workers."""
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            application,
            "--bind",
            f"127.0.0.1:{self.port}",
            "--workers",
            str(self.WORKERS),
            # Longer than any test: a slow or frozen worker is never killed by gunicorn.
            "--timeout",
            "300",
            "--graceful-timeout",
            "3",
            "--preload",
            "--access-logfile",
            "-",
        ]
        if _gunicorn_has_control_socket():
            # Its default path is one per user, shared with every other gunicorn of theirs.
            command.append("--no-control-socket")
        return command

    def wait_until_up(self) -> None:
        def answers() -> bool:
            if self.popen.poll() is not None:
                msg = f"{self.name} exited with {self.popen.returncode}:\n{self.log()}"
                raise AssertionError(msg)
            try:
                self.send("GET", "/api/payments/", auth=False, timeout=1)
            except OSError:
                return False
            return len(self.workers()) == self.WORKERS

        wait_for(answers, timeout=START_TIMEOUT, interval=0.1, what=f"{self.name} to answer")

    def workers(self) -> list[int]:
        return children(self.pid)

    def freeze(self, pid: int) -> None:
        assert pid in self.workers(), f"{pid} is not one of this server's workers"
        os.kill(pid, signal.SIGSTOP)

    def thaw(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)

    def kill(self, pid: int) -> None:
        """Kill a worker as the OOM killer or an operator's ``kill -9`` does; the server
        starts another in its place."""
        assert pid in self.workers(), f"{pid} is not one of this server's workers"
        os.kill(pid, signal.SIGKILL)

    def worker_serving(self, request: PendingRequest) -> int:
        """The worker that accepted ``request``'s connection (it holds the server's end)."""

        def accepted() -> int | None:
            inode = _socket_inode(self.port, request.local_port)
            if inode is None:
                return None
            for pid in self.workers():
                with contextlib.suppress(OSError):  # a worker that just exited
                    for fd in Path(f"/proc/{pid}/fd").iterdir():
                        with contextlib.suppress(OSError):
                            if os.readlink(fd) == f"socket:[{inode}]":
                                return pid
            return None

        pid: int = wait_for(accepted, timeout=REQUEST_TIMEOUT, what="a worker to accept")
        return pid

    def open_request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        headers: list[tuple[str, str]] | None = None,
        key: str | None = None,
        auth: bool = True,
        chunked: bool = False,
        timeout: float = REQUEST_TIMEOUT,
    ) -> PendingRequest:
        """Send one request on a connection of its own; its answer is read later, or never.

        ``headers`` is a list: a name given twice goes on the wire as two header lines. A
        ``chunked`` body is sent with ``Transfer-Encoding: chunked`` and no ``Content-Length``.
        """
        lines = list(headers or [])
        if auth:
            lines.append(basic_auth())
        if key is not None:
            lines.append(("Idempotency-Key", key))
        if body is not None and not any(name.lower() == "content-type" for name, _ in lines):
            lines.append(("Content-Type", "application/json"))
        started = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.putrequest(method, path, skip_accept_encoding=True)
            for name, value in lines:
                connection.putheader(name, value)
            connection.putheader("Connection", "close")
            if chunked:
                connection.putheader("Transfer-Encoding", "chunked")
            else:
                connection.putheader("Content-Length", str(len(body or b"")))
            connection.endheaders()
            if chunked:
                connection.send(chunks(body or b""))
            elif body:
                connection.send(body)
        except BaseException:
            connection.close()
            raise
        return PendingRequest(connection, started)

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        *,
        headers: list[tuple[str, str]] | None = None,
        key: str | None = None,
        auth: bool = True,
        chunked: bool = False,
        timeout: float = REQUEST_TIMEOUT,
    ) -> Answer:
        """Send one request on a connection of its own, and read its answer (see
        ``open_request``)."""
        pending = self.open_request(
            method,
            path,
            body,
            headers=headers,
            key=key,
            auth=auth,
            chunked=chunked,
            timeout=timeout,
        )
        return pending.answer()

    def post_json(self, path: str, data: Any, **options: Any) -> Answer:
        return self.send("POST", path, json.dumps(data).encode(), **options)


class PendingRequest:
    """A request sent, whose answer is not read yet: read it, or hang up without it."""

    def __init__(self, connection: http.client.HTTPConnection, started: float) -> None:
        self.connection = connection
        self.started = started
        assert connection.sock is not None
        self.local_port: int = connection.sock.getsockname()[1]

    def answer(self) -> Answer:
        """The answer; an ``OSError`` if the server hung up without one, or took too long."""
        try:
            response = self.connection.getresponse()
            return Answer(
                response.status, response.headers, response.read(), time.monotonic() - self.started
            )
        finally:
            self.connection.close()

    def hang_up(self) -> None:
        """Close the connection without waiting for the answer, as a client that gave up does."""
        self.connection.close()


class GunicornUvicornServer(Server):
    """The example project's ASGI application under gunicorn with uvicorn's worker class."""

    name = "gunicorn (uvicorn workers)"

    def command(self) -> list[str]:
        return [
            *self.gunicorn("example_project.asgi:application"),
            "--worker-class",
            uvicorn_worker_class(),
        ]


def uvicorn_worker_class() -> str:
    """uvicorn's worker class for gunicorn: from the uvicorn-worker package, where it moved,
    else from uvicorn itself (deprecated there since uvicorn 0.30)."""
    if find_spec("uvicorn_worker") is not None:
        return "uvicorn_worker.UvicornWorker"
    return "uvicorn.workers.UvicornWorker"


class UvicornServer(Server):
    """The example project's ASGI application under uvicorn's own process manager, which starts
    a worker in the place of one that died, as gunicorn's arbiter does.

    It also kills a worker that does not answer its health check within
    ``--timeout-worker-healthcheck`` seconds: do not ``freeze`` one for longer.
    """

    name = "uvicorn"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "uvicorn",
            "example_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(self.WORKERS),
            # Django has no lifespan handler: without this uvicorn says so at every start.
            "--lifespan",
            "off",
            "--timeout-graceful-shutdown",
            "3",
        ]

    def workers(self) -> list[int]:
        # Not multiprocessing's resource tracker, a child of the manager too.
        return [pid for pid in children(self.pid) if b"spawn_main" in _command_line(pid)]


ASGI_SERVERS: dict[str, type[Server]] = {
    "uvicorn": UvicornServer,
    "gunicorn+uvicorn": GunicornUvicornServer,
}
"""The ASGI servers the example is served with, by the name tests are parametrized with."""


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _socket_inode(local_port: int, remote_port: int) -> int | None:
    """The inode of the loopback TCP socket from ``local_port`` to ``remote_port``, once a
    process has accepted it (the kernel shows 0 before)."""
    wanted = (f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}")
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (fields[1], fields[2]) == wanted and int(fields[9]):
            return int(fields[9])
    return None


def _gunicorn_has_control_socket() -> bool:
    from gunicorn.config import KNOWN_SETTINGS  # noqa: PLC0415 - gunicorn is checked for first

    return any(setting.name == "control_socket_disable" for setting in KNOWN_SETTINGS)


def chunks(body: bytes, size: int = 16) -> bytes:
    """``body`` in the chunked transfer coding (RFC 9112, section 7.1), a few chunks long."""
    pieces = [body[start : start + size] for start in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


class Redis(Process):
    """A redis-server of the test's own, on a free loopback port, persisting nothing."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        super().__init__(command, env=dict(os.environ), log=log, cwd=log.parent)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def wait_until_up(self) -> None:
        def answers() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as connection:
                    connection.sendall(b"PING\r\n")
                    return connection.recv(16).startswith(b"+PONG")
            except OSError:
                return False

        wait_for(answers, timeout=START_TIMEOUT, interval=0.05, what="redis-server to answer")

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
