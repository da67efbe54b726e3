"""The docs keep up with the code: every setting and every check id is documented, every page is
in the docs site's navigation, and the examples that stand alone run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from django_idempotency import conf, problems
from django_idempotency.conf import DEFAULTS
from django_idempotency.operations import checks
from django_idempotency.signing import StandardWebhooksSignature

DOCS = Path(__file__).resolve().parent.parent / "docs"
MKDOCS = DOCS.parent / "mkdocs.yml"


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_every_setting_is_documented(name):
    assert re.search(rf"^### {name}$", (DOCS / "settings.md").read_text(), re.MULTILINE)


SOURCES = "".join(Path(module.__file__).read_text() for module in (checks, conf))


@pytest.mark.parametrize(
    "check_id", sorted(set(re.findall(r"django_idempotency\.[EW]\d{3}", SOURCES)))
)
def test_every_check_is_documented(check_id):
    assert check_id in (DOCS / "checks.md").read_text()


@pytest.mark.parametrize("problem", problems.ALL, ids=lambda problem: problem.code)
def test_every_error_code_is_documented(problem):
    assert problem.code in (DOCS / "errors.md").read_text()


@pytest.mark.parametrize("problem", problems.ALL, ids=lambda problem: problem.code)
def test_every_error_code_says_whether_to_retry_and_with_which_key(problem):
    row = re.search(
        rf"^\| `{re.escape(problem.code)}` \| (\d+) \|([^|]+)\|([^|]+)\|([^|]+)\|$",
        (DOCS / "errors.md").read_text(),
        re.MULTILINE,
    )
    assert row, f"{problem.code} has no row in the errors page's retry table"
    assert int(row.group(1)) == problem.status
    assert all(cell.strip() for cell in row.groups()[1:])


def nav_pages() -> set[str]:
    """The pages under `nav:` in mkdocs.yml, read without a YAML parser (`- Title: page.md`)."""
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n|\n)*)", MKDOCS.read_text(), re.MULTILINE)
    assert nav, "mkdocs.yml has no nav"
    return set(re.findall(r"^\s*-\s+(?:.*:\s+)?(\S+\.md)\s*$", nav.group(1), re.MULTILINE))


@pytest.mark.parametrize(
    "page", sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
)
def test_every_page_is_in_the_site_navigation(page):
    assert page in nav_pages()


def test_the_site_navigation_lists_only_existing_pages():
    assert {page for page in nav_pages() if not (DOCS / page).is_file()} == set()


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)


def test_the_inbox_senders_example_signs_a_delivery_as_a_plain_script():
    """The sender example runs as it is, without Django settings, and its delivery verifies."""
    (script,) = [b for b in python_blocks(DOCS / "inbox.md") if "signer.sign(" in b]
    received: list[tuple[dict[str, str], bytes]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((dict(self.headers), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/webhooks/orders/"
    try:
        script = script.replace("https://billing.example.com/webhooks/orders/", url)
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    (secret,) = re.findall(r'"(whsec_[^"]+)"', script)
    [(headers, body)] = received
    StandardWebhooksSignature([secret]).verify(headers, body)  # raises if the signature is wrong
    assert json.loads(body)["id"] == "evt_1042"


def test_the_changelog_page_is_the_changelog_itself():
    # A link to the file: the docs site shows CHANGELOG.md, and a code host links to it, where an
    # include directive would show as a raw line.
    assert (DOCS / "changelog.md").resolve() == (DOCS.parent / "CHANGELOG.md").resolve()
