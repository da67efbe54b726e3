"""Brokers of the fault tests' own: a RabbitMQ node and a Redis on ports of their own, never the
machine's shared ones, and a TCP proxy whose connections a test can cut or freeze."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import uuid
from pathlib import Path

from tests.blackbox.harness import Process, free_port, wait_for

# Debian installs the server's own scripts here; those in /usr/sbin would switch user.
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBITMQCTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"
START_TIMEOUT = 60.0


def rabbitmq_installed() -> bool:
    return Path(RABBITMQ_SERVER).exists()


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class RabbitMQ:
    """A RabbitMQ node of the test's own: its port, its node name, its data in ``directory``.

    Stopped and started again, it keeps its durable queues and persistent messages.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.dist_port = free_port()
        self.node = f"test-{uuid.uuid4().hex[:8]}@localhost"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}//"
        directory.mkdir(parents=True, exist_ok=True)
        # Its own configuration, not the machine's (which names the shared node's port).
        (directory / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n"
        )
        (directory / "rabbitmq-env.conf").write_text("")
        (directory / "enabled_plugins").write_text("[].\n")
        self.process: Process | None = None
        self.starts = 0
        self.env = {
            **os.environ,
            # The node's Erlang cookie, which rabbitmqctl needs too, in its directory: not in
            # the user's home, shared with every other node.
            "HOME": str(directory),
            "RABBITMQ_CONF_ENV_FILE": str(self.directory / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.directory / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.directory / "enabled_plugins"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.directory / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.directory / "log"),
            "RABBITMQ_PID_FILE": str(self.directory / "pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def start(self) -> None:
        self.starts += 1
        log = self.directory / f"server-{self.starts}.log"
        self.process = Process([RABBITMQ_SERVER], env=self.env, log=log, cwd=self.directory)
        wait_for(
            lambda: answers(self.port) or self.process.popen.poll() is not None,  # type: ignore[union-attr]
            timeout=START_TIMEOUT,
            interval=0.1,
            what="RabbitMQ to answer",
        )
        assert self.process.popen.poll() is None, self.process.log()

    def ctl(self, *args: str) -> str:
        """Run ``rabbitmqctl`` on this node, as an operator would; return what it printed."""
        completed = subprocess.run(
            [RABBITMQCTL, "-n", self.node, "-q", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert completed.returncode == 0, completed.stdout + completed.stderr
        return completed.stdout

    def stop(self) -> None:
        """Stop the node as an operator would: it closes every connection, keeps its data."""
        if self.process is not None:
            self.process.stop(grace=30)
            self.process = None

    def delete(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class Proxy:
    """Forward a local port to ``port``; :meth:`cut` drops every connection open through it,
    :meth:`freeze` holds what either side sends, as a broker that stopped answering does, and
    :meth:`deafen` what the broker sends, as one that takes messages but confirms none does."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.cuts = 0
        self.flowing = threading.Event()
        self.flowing.set()
        self.answering = threading.Event()
        self.answering.set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                self.open |= {client, upstream}
            for source, sink, gates in (
                (client, upstream, [self.flowing]),
                (upstream, client, [self.flowing, self.answering]),
            ):
                threading.Thread(target=self._pump, args=(source, sink, gates), daemon=True).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, gates: list[threading.Event]
    ) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                for gate in gates:
                    gate.wait()
                sink.sendall(data)
        for end in (source, sink):
            self._close(end)

    def _close(self, end: socket.socket) -> None:
        with self.lock:
            self.open.discard(end)
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)
        end.close()

    def cut(self) -> None:
        self.cuts += 1
        with self.lock:
            ends = list(self.open)
        for end in ends:
            self._close(end)

    def freeze(self) -> None:
        """Forward nothing more, either way, until :meth:`thaw`; the connections stay open."""
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()
        self.answering.set()

    def deafen(self) -> None:
        """Forward what the client sends, but nothing the broker sends, until :meth:`thaw`."""
        self.answering.clear()

    def close(self) -> None:
        self.listener.close()
        self.cut()
        self.thaw()


def kill(process: Process) -> None:
    """SIGKILL the process and whatever it started."""
    process.signal_group(signal.SIGKILL)
    process.popen.wait(timeout=10)
