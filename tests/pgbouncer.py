"""A PgBouncer of the tests' own, in transaction pooling mode, in front of the PostgreSQL that
PGHOST and PGPORT name: the connection that many production deployments have.

runtests.py starts one for its PgBouncer pass and tells the tests its port in
TEST_PGBOUNCER_PORT: tests/settings.py then connects through it, and the black-box tests serve
the example project through it. Debian's ``pgbouncer`` package provides the program.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# PgBouncer refuses to run as root; this user owns PostgreSQL's own files on Debian.
UNPRIVILEGED_USER = "postgres"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PgBouncer:
    """``pgbouncer`` on a free loopback port: every database, transaction pooling, trust."""

    def __init__(self) -> None:
        self.executable = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.log_path = self.directory / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server_host = os.environ.get("PGHOST", "127.0.0.1")
        server_port = os.environ.get("PGPORT", "5432")
        user = os.environ.get("PGUSER", "postgres")
        config = self.directory / "pgbouncer.ini"
        users = self.directory / "users.txt"
        users.write_text(f'"{user}" ""\n')
        config.write_text(
            "[databases]\n"
            f"* = host={server_host} port={server_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {users}\n"
            "pool_mode = transaction\n"
            # Enough for the races' threads and the served project's workers together.
            "max_client_conn = 1000\ndefault_pool_size = 60\n"
            f"logfile = {self.log_path}\n"
            # What drivers send at startup that PgBouncer would otherwise refuse.
            "ignore_startup_parameters = extra_float_digits,options\n"
        )
        command = [self.executable, "--quiet", str(config)]
        if os.geteuid() == 0:
            shutil.chown(self.directory, UNPRIVILEGED_USER)
            for path in (config, users):
                shutil.chown(path, UNPRIVILEGED_USER)
            command[1:1] = ["--user", UNPRIVILEGED_USER]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        self.wait_until_up()

    def wait_until_up(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                msg = f"pgbouncer exited with {self.process.returncode}:\n{self.log()}"
                raise RuntimeError(msg)
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    msg = f"pgbouncer did not listen on port {self.port}:\n{self.log()}"
                    raise RuntimeError(msg) from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)
