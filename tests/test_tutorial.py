"""docs/tutorial.md, followed to the letter: its project built from its code blocks, served by
runserver, and its commands run against it. A reader who types what the page says gets what the
page promises: one payment for two requests, one message sent, one webhook processed of two
deliveries.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "tutorial.md"
FILE_BLOCK = re.compile(
    r"```python\n# (?P<path>[\w/]+\.py)(?P<append> \(at the end\))?\n(?P<code>.*?)```", re.S
)
BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="the tutorial uses curl")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def commands(text: str) -> list[str]:
    """The shell commands of the page's bash blocks, continuation lines joined."""
    found = []
    for block in BASH_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            if command := line.split("  #")[0].strip():
                found.append(command)
    return found


@pytest.fixture
def project(tmp_path):
    """The tutorial's project, built as its first steps say (the virtualenv is this one)."""
    # A reader's shell: not the test run's settings, path, or PYTHONSAFEPATH (which the run on
    # the installed wheel sets, and which would keep manage.py from finding the project).
    unset = {"DJANGO_SETTINGS_MODULE", "PYTHONPATH", "PYTHONSAFEPATH"}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    text = PAGE.read_text()

    def run(*args: str) -> str:
        done = subprocess.run(
            args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, f"{args}: {done.stdout}{done.stderr}"
        return done.stdout

    assert "django-admin startproject shop ." in commands(text)
    run(sys.executable, "-m", "django", "startproject", "shop", ".")
    run(sys.executable, "manage.py", "startapp", "payments")
    for block in FILE_BLOCK.finditer(text):
        target = tmp_path / block["path"]
        if block["append"]:
            target.write_text(target.read_text() + "\n" + block["code"])
        else:
            target.write_text(block["code"])
    run(sys.executable, "manage.py", "makemigrations", "payments")
    run(sys.executable, "manage.py", "migrate")
    return tmp_path, env, run


def test_the_tutorial_does_what_it_says(project):
    folder, env, run = project
    text = PAGE.read_text()
    port = free_port()
    log = (folder / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        cwd=folder,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # runserver checks the project first: on a loaded machine that takes seconds.
        deadline = time.monotonic() + 60
        while server.poll() is None and time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError((folder / "server.log").read_text())
        at = f"127.0.0.1:{port}"
        curls = [c.replace("127.0.0.1:8000", at) for c in commands(text) if c.startswith("curl")]
        assert len(curls) == 3
        # The page's key, made once as its one line does, and sent by each curl as the reader's
        # shell would: a random UUID, since the requests are anonymous.
        (make_key,) = [c for c in commands(text) if c.startswith("KEY=")]
        key = run("bash", "-c", f'{make_key} && printf %s "$KEY"')
        assert uuid.UUID(key).version == 4
        answers = [run("bash", "-c", f"KEY={key}; {command}") for command in curls]
        stored, replayed, refused = answers
        assert stored.startswith("HTTP/1.1 201")
        assert "Idempotency-Status: stored" in stored
        assert replayed.startswith("HTTP/1.1 201")
        assert "Idempotency-Status: replayed" in replayed
        assert stored.split("\n\n")[1] == replayed.split("\n\n")[1]  # the same body
        assert refused.startswith("HTTP/1.1 422")
        assert "Content-Type: application/problem+json" in refused

        script = (folder / "send_webhook.py").read_text().replace("127.0.0.1:8000", at)
        (folder / "send_webhook.py").write_text(script)
        deliveries = run(sys.executable, "send_webhook.py").splitlines()
        assert [line.split()[:2] for line in deliveries] == [["1", "200"], ["2", "200"]]
        assert "duplicate" in deliveries[1]
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()
    state = run(
        sys.executable,
        "manage.py",
        "shell",
        "-c",
        "from payments.models import Payment; print([(p.amount, p.refunded) for p in "
        "Payment.objects.all()])",
    )
    assert state.splitlines()[-1] == "[(1000, True)]"  # one payment, refunded once
    assert (folder / "server.log").read_text().count("payment.created sent") == 1
