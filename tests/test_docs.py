"""The docs keep up with the code: every setting and every check id is documented, every page is
in the docs site's navigation, the examples that stand alone run and import what they use, and no
page names a management command, setting or problem code that the code does not have."""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import subprocess
import symtable
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from django.core.management import get_commands

from django_idempotency import conf, problems
from django_idempotency.conf import DEFAULTS
from django_idempotency.operations import checks
from django_idempotency.signing import StandardWebhooksSignature
from tests import docs_project
from tests.test_docs_samples import PAGES, Block, blocks, is_settings

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


# --- what a runnable block uses, it imports -------------------------------------------------


def undefined_names(code: str) -> set[str]:
    """The names ``code`` reads that nothing in it defines or imports, builtins aside: at the top
    level, or inside a function or class, where running the block would not find them missing."""
    try:
        top = symtable.symtable(code, "<block>", "exec")
    except SyntaxError:
        # ``await`` at the top level, which the samples' runner runs in an event loop.
        wrapped = "async def _block():\n" + textwrap.indent(code, "    ")
        top = symtable.symtable(wrapped, "<block>", "exec").get_children()[0]
    defined = {
        symbol.get_name()
        for symbol in top.get_symbols()
        if symbol.is_assigned() or symbol.is_imported() or symbol.is_parameter()
    }
    missing: set[str] = set()

    def walk(table: symtable.SymbolTable, outermost: bool) -> None:
        for symbol in table.get_symbols():
            name = symbol.get_name()
            if not symbol.is_referenced() or name in defined:
                continue
            # Below the top, a name of an enclosing function is free, not global: defined there.
            if outermost or symbol.is_global():
                missing.add(name)
        for child in table.get_children():
            walk(child, outermost=False)

    walk(top, outermost=True)
    return {
        name
        for name in missing
        if not hasattr(builtins, name) and not (name.startswith("__") and name.endswith("__"))
    }


def test_undefined_names_sees_a_name_a_function_reads_and_nothing_imports():
    code = (
        "import json\n\ndef save(data):\n    with transaction.atomic():\n        json.dumps(data)\n"
    )
    assert undefined_names(code) == {"transaction"}
    assert undefined_names("async with client:\n    await client.get(url)\n") == {"client", "url"}
    assert undefined_names(
        "class A:\n    x = 1\n    def f(self):\n        return [x for x in y]\n"
    ) == {"y"}


def runnable_blocks() -> list[Block]:
    return [block for block in blocks() if not block.fragment]


def settings_names_before(block: Block) -> set[str]:
    """What the settings blocks above ``block`` on its page import: a settings page builds one
    settings module (its first block imports ``timedelta`` for the rest)."""
    names: set[str] = set()
    for earlier in runnable_blocks():
        if earlier.page != block.page or earlier.line >= block.line:
            continue
        tree = ast.parse(earlier.code)
        if is_settings(tree):
            imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
            names.update(
                (alias.asname or alias.name).partition(".")[0]
                for node in imports
                for alias in node.names
            )
    return names


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda block: block.where)
def test_a_runnable_block_imports_what_it_uses(block):
    """A block not marked as a fragment is a program a reader can paste: each name it uses is
    imported or defined in it. The reader's own models, serializer and services
    (``docs_project.PROJECT``) are the exception, as the samples' runner gives them."""
    given = set(docs_project.PROJECT)
    if is_settings(ast.parse(block.code)):
        given |= settings_names_before(block)
    assert undefined_names(block.code) - given == set(), (
        f"{block.where} uses names it never imports"
    )


# --- what a page names, the code has ---------------------------------------------------------

# Every page a reader may read, the changelog aside: it names what was, too.
NAMED_PAGES = [page for page in [*PAGES, DOCS.parent / "CONTRIBUTING.md"] if not page.is_symlink()]
EXAMPLE_COMMANDS = DOCS.parent / "example_project" / "payments" / "management" / "commands"


def named(pattern: str) -> list[tuple[str, str]]:
    """``(page, the first group)`` of each match of ``pattern`` in the pages."""
    return [
        (page.relative_to(DOCS.parent).as_posix(), match.group(1))
        for page in NAMED_PAGES
        for match in re.finditer(pattern, page.read_text())
    ]


def test_every_management_command_a_page_runs_exists():
    commands = set(get_commands()) | {path.stem for path in EXAMPLE_COMMANDS.glob("[a-z]*.py")}
    ran = named(r"(?:manage\.py|django-admin)\s+([a-z][a-z_]*)")
    assert ran, "no page runs a command: the pattern is wrong"
    assert [(page, name) for page, name in ran if name not in commands] == []


def test_every_setting_key_a_page_names_exists():
    keys = [
        *named(r"IDEMPOTENCY\[['\"](\w+)['\"]\]"),
        # The keys of an IDEMPOTENCY = {...} dict, in a code block or inline.
        *[
            (page, key)
            for page, body in named(r"IDEMPOTENCY\s*=\s*\{(.*?)\}")
            for key in re.findall(r"[\"']([A-Z][A-Z0-9_]*)[\"']\s*:", body)
        ],
        # A link to the settings page named as a setting: [`WAIT_TIMEOUT`](settings.md#...).
        *named(r"\[`([A-Z][A-Z0-9_]*)`\]\(settings\.md#"),
    ]
    assert len(keys) > 20, "the patterns find almost no setting: they are wrong"
    assert [(page, key) for page, key in keys if key not in DEFAULTS] == []
    headings = re.findall(r"^### ([A-Z][A-Z0-9_]*)$", (DOCS / "settings.md").read_text(), re.M)
    assert set(headings) - set(DEFAULTS) == set()


PROBLEM_CODES = {
    value.code for value in vars(problems).values() if isinstance(value, problems.Problem)
}
PREFIXES = "|".join(
    sorted({re.escape(code.partition(".")[0]) for code in PROBLEM_CODES if "." in code})
)


def test_every_problem_code_a_page_names_exists():
    codes = [
        *named(r'"code": "([\w.]+)"'),  # an answer's body
        *named(r"tag:django-idempotency,\d{4}:([\w.]+)"),  # its type
        *named(r"^\| `([\w.]+)` \| \d{3} \|"),  # a row of the errors page's tables
        *named(rf"\b[1-5]\d\d`? `?((?:{PREFIXES})\.[a-z_]+)\b"),  # `409 idempotency.in_progress`
    ]
    assert len(codes) > 20, "the patterns find almost no code: they are wrong"
    assert [(page, code) for page, code in codes if code not in PROBLEM_CODES] == []


# --- the release status, said one way ---------------------------------------------------------

VERSION = re.search(
    r'^version = "([^"]+)"', (DOCS.parent / "pyproject.toml").read_text(), re.MULTILINE
)
INDEX_INSTALL = re.compile(r'^pip install "?django-idempotency\b', re.MULTILINE)


def unreleased() -> bool:
    """Whether the changelog lists the project's version as not yet published."""
    assert VERSION, "pyproject.toml has no version"
    heading = re.search(
        rf"^## {re.escape(VERSION.group(1))} \((.*)\)$",
        (DOCS.parent / "CHANGELOG.md").read_text(),
        re.MULTILINE,
    )
    assert heading, f"the changelog has no heading for {VERSION.group(1)}"
    return "unreleased" in heading.group(1)


@pytest.mark.parametrize("page", NAMED_PAGES, ids=lambda page: page.name)
def test_a_page_that_installs_from_the_index_says_how_to_before_a_release(page):
    """Until the version is published, ``pip install django-idempotency`` fails (or finds another
    package of that name): a page that shows it says how to install from a checkout."""
    if not unreleased():
        pytest.skip("the version is published")
    text = page.read_text()
    if INDEX_INSTALL.search(text) and page.name != "installation.md":
        assert "installation.md#install-the-package" in text
        assert "No release is on the package index yet" in text


# --- an anonymous key is unguessable ----------------------------------------------------------

CURL = re.compile(r"^curl\b.*?(?<!\\)$", re.MULTILINE | re.DOTALL)
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def anonymous_keys() -> list[tuple[str, str]]:
    """``(page, key)`` of each curl in a bash block that sends a key without credentials."""
    found = []
    for page in NAMED_PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.DOTALL):
            for command in CURL.findall(block):
                if re.search(r"\s(?:-u|--user)\s|Authorization:|Cookie:", command):
                    continue
                for key in re.findall(r"Idempotency-Key: ([^\"'\s]+)", command):
                    found.append((page.name, key))
    return found


def test_an_anonymous_request_in_the_docs_sends_an_unguessable_key():
    """Anonymous clients share one scope: a key another client can guess (an order number)
    would hand it this request's answer, as the concepts page says. The docs send a UUID."""
    keys = anonymous_keys()
    assert keys, "no page sends an anonymous key: the pattern is wrong"
    guessable = [(page, key) for page, key in keys if not (key.startswith("$") or UUID.match(key))]
    assert guessable == []
