"""Every ```python block of README.md and docs/*.md runs here, or is marked as a fragment.

How a block runs depends on what it is:

- **Settings** (only ``NAME = value`` assignments in capitals, and imports): the values are put in
  place with ``override_settings`` and proved with what reads them: the library's system checks for
  ``IDEMPOTENCY`` (no error or warning of ours), a request through the ``MIDDLEWARE``, Django's
  cache handler for ``CACHES``, DRF's settings for ``REST_FRAMEWORK``, ``dictConfig`` in a fresh
  process for ``LOGGING``, the app registry for ``INSTALLED_APPS``, the backend for ``DATABASES``.
  A settings block runs as a settings module that already has ``from datetime import timedelta``,
  as the settings page's first example does; ``...`` in a list or as a dict value stands for the
  reader's other entries and is left out.
- **Code**: it runs as a throwaway module (named after a ``# package/module.py`` first line, so its
  relative imports work), with the reader's own names (``Payment``, ``PaymentSerializer``,
  ``provider``…, see ``tests/docs_project.py``) given and nothing of the library's. Each
  ``IdempotentMixin`` view it defines builds its policy, and the blocks listed in ``EXERCISES``
  are then used as a reader would: their views called over HTTP with the test client, their clients
  sent to a live local server (``https://ledger.example.com`` is rewritten to it).
  ``async with``/``await`` at the top level run in an event loop.
- **Tests** (a block that defines ``test_*`` functions): they run with pytest in a subprocess,
  against the reader's project of ``tests/docs_project.py``.

A block that cannot run alone (it continues the previous block, or shows a signature or a
placeholder) is marked with an HTML comment, invisible on the rendered page, on the line right
before its fence::

    <!-- fragment -->
    ```python

A block that neither runs nor is marked fails, naming its file and line.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator  # noqa: TC003  (read by pytest at run time)
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock
from xml.etree import ElementTree

import pytest
from django.apps import AppConfig
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.core.cache import caches
from django.core.checks import Warning as CheckWarning
from django.core.checks import run_checks
from django.db.utils import load_backend
from django.test import Client, override_settings
from django.test.client import RequestFactory
from django.urls import clear_url_caches
from rest_framework.settings import api_settings

from django_idempotency.drf import IdempotentMixin
from django_idempotency.inbox import handlers
from django_idempotency.outbox import dispatchers
from tests import docs_project

# Pages other work is rewriting right now: their blocks are collected but not yet held to the
# rule. Pending: remove each page from this list once its samples run or are marked.
PENDING_PAGES = frozenset({"docs/inbox.md", "docs/operations.md", "docs/admin.md", "docs/tasks.md"})

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = re.compile(r"^<!-- fragment(?: [^>]*)? -->$")
FENCE = re.compile(r"^```python\s*$")
HEADER = re.compile(r"^# ([\w/]+)\.py\b")
EXAMPLE_HOST = "https://ledger.example.com"


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the fence's line, 1-based
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> Iterator[Block]:
    for page in PAGES:
        if page.is_symlink():  # docs/changelog.md is CHANGELOG.md
            continue
        lines = page.read_text().splitlines()
        name = page.relative_to(ROOT).as_posix()
        index = 0
        while index < len(lines):
            if FENCE.match(lines[index]):
                end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
                fragment = index > 0 and bool(FRAGMENT.match(lines[index - 1]))
                code = "\n".join(lines[index + 1 : end]) + "\n"
                yield Block(name, index + 1, code, fragment)
                index = end
            index += 1


def params() -> list[Any]:
    found = []
    for block in blocks():
        marks = []
        if block.page in PENDING_PAGES:
            marks.append(pytest.mark.skip(reason=f"{block.page} is pending"))
        elif block.fragment:
            marks.append(pytest.mark.skip(reason="marked as a fragment"))
        found.append(pytest.param(block, id=block.where, marks=marks))
    return found


# --- settings ------------------------------------------------------------------------------------


def is_settings(tree: ast.Module) -> bool:
    def statement(node: ast.stmt) -> bool:
        if isinstance(node, ast.Import | ast.ImportFrom):
            return True
        return (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.isupper()
        )

    return all(statement(node) for node in tree.body)


def without_placeholders(value: Any) -> Any:
    """``value`` without the ``...`` that stand for the reader's other entries."""
    if isinstance(value, list):
        return [without_placeholders(item) for item in value if item is not Ellipsis]
    if isinstance(value, dict):
        return {
            key: without_placeholders(item)
            for key, item in value.items()
            if item is not Ellipsis and item != {Ellipsis}
        }
    return value


def our_messages() -> list[Any]:
    return [
        message
        for message in run_checks()
        if message.id and message.id.startswith("django_idempotency.")
    ]


def prove_idempotency(value: dict[str, Any], client: Client) -> None:
    messages = our_messages()
    assert messages == [], messages


def prove_middleware(value: list[str], client: Client) -> None:
    response = Client().get("/payments/")
    assert response.status_code < 500, response


def prove_caches(value: dict[str, Any], client: Client) -> None:
    for alias in value:
        caches[alias]  # the backend imports and accepts its options
    assert [m for m in our_messages() if not isinstance(m, CheckWarning)] == []


def prove_rest_framework(value: dict[str, Any], client: Client) -> None:
    for name in value:
        assert getattr(api_settings, name)  # imports every dotted path


def prove_installed_apps(value: list[str], client: Client) -> None:
    for name in value:
        AppConfig.create(name)


def prove_databases(value: dict[str, Any], client: Client) -> None:
    for database in value.values():
        load_backend(database["ENGINE"])


LOGGING_PROCESS = """
import logging, logging.config, django
django.setup()
logging.config.dictConfig({logging!r})
logging.getLogger("django_idempotency").warning("a record from the sample")
"""


def prove_logging(value: dict[str, Any], client: Client) -> None:
    result = subprocess.run(
        [sys.executable, "-c", LOGGING_PROCESS.format(logging=value)],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "a record from the sample" in result.stderr, result.stderr


PROVE: dict[str, Callable[[Any, Client], None]] = {
    "IDEMPOTENCY": prove_idempotency,
    "MIDDLEWARE": prove_middleware,
    "CACHES": prove_caches,
    "REST_FRAMEWORK": prove_rest_framework,
    "INSTALLED_APPS": prove_installed_apps,
    "DATABASES": prove_databases,
    "LOGGING": prove_logging,
}


def run_settings(block: Block, client: Client) -> None:
    namespace: dict[str, Any] = {"timedelta": timedelta}
    exec(compile(block.code, block.where, "exec"), namespace)  # noqa: S102  (the docs' own samples)
    values = {
        name: without_placeholders(value)
        for name, value in namespace.items()
        if name.isupper() and not name.startswith("_")
    }
    unknown = sorted(set(values) - set(PROVE))
    assert not unknown, f"{block.where}: no way to prove {unknown}; add one to PROVE"
    overrides = dict(values)
    if "MIDDLEWARE" in overrides:
        overrides["MIDDLEWARE"] = [
            *overrides["MIDDLEWARE"],
            *(m for m in settings.MIDDLEWARE if m not in overrides["MIDDLEWARE"]),
        ]
    if "REST_FRAMEWORK" in overrides:
        overrides["REST_FRAMEWORK"] = {**settings.REST_FRAMEWORK, **overrides["REST_FRAMEWORK"]}
    if "CACHES" in overrides:
        overrides["CACHES"] = {**settings.CACHES, **overrides["CACHES"]}
    # Settings that a test process must keep as they are are proved without being put in place.
    for name in ("INSTALLED_APPS", "DATABASES", "LOGGING"):
        overrides.pop(name, None)
    with override_settings(**overrides):
        for name, value in values.items():
            PROVE[name](value, client)
        if "IDEMPOTENCY" not in values:
            assert our_messages() == []


# --- code ----------------------------------------------------------------------------------------


class Ledger(BaseHTTPRequestHandler):
    """The ledger service the client samples call: it answers every request with JSON."""

    def answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        payload = json.dumps({"path": self.path, "received": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def ledger() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Ledger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run_code(block: Block, ledger: str) -> types.ModuleType:
    name = header_name(block) or "docsample_" + re.sub(r"\W", "_", block.where)
    module = types.ModuleType(name)
    module.__dict__.update(docs_project.PROJECT)
    if "." in name:
        module.__package__ = name.rpartition(".")[0]
        importlib.import_module(module.__package__)
    previous = sys.modules.get(name)
    sys.modules[name] = module
    code = compile(
        block.code.replace(EXAMPLE_HOST, ledger),
        block.where,
        "exec",
        flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT,
    )
    try:
        result = eval(code, module.__dict__)  # noqa: S307  (the docs' own samples)
        if inspect.iscoroutine(result):
            asyncio.run(result)
    finally:
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    return module


def header_name(block: Block) -> str | None:
    header = HEADER.match(block.code)
    return header.group(1).replace("/", ".") if header and "/" in header.group(1) else None


class DocsFiles(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the reader's files that the docs show: a block that starts ``# orders/outbox.py``
    is ``orders.outbox``, the nearest one before the running block on its page, else any page's."""

    def __init__(self, current: Block, ledger: str) -> None:
        self.current = current
        self.ledger = ledger
        self.files: dict[str, list[Block]] = {}
        for block in blocks():
            name = header_name(block)
            if name and not block.fragment and block.page not in PENDING_PAGES:
                self.files.setdefault(name, []).append(block)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in self.files:
            return importlib.util.spec_from_loader(fullname, self)
        if any(name.startswith(fullname + ".") for name in self.files):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        candidates = self.files.get(module.__name__)
        if not candidates:
            return  # a package
        before = [
            b for b in candidates if b.page == self.current.page and b.line < self.current.line
        ]
        block = before[-1] if before else candidates[0]
        module.__dict__.update(docs_project.PROJECT)
        code = compile(block.code.replace(EXAMPLE_HOST, self.ledger), block.where, "exec")
        exec(code, module.__dict__)  # noqa: S102  (the docs' own samples)


@contextmanager
def readers_files(block: Block, ledger: str) -> Iterator[None]:
    """The docs' files importable while ``block`` runs; the registries as they were after it."""
    finder = DocsFiles(block, ledger)
    modules = set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        with (
            mock.patch.dict(dispatchers._registry),
            mock.patch.dict(handlers._registry),
        ):
            yield
    finally:
        sys.meta_path.remove(finder)
        for name in set(sys.modules) - modules:
            if name.partition(".")[0] in READERS_PACKAGES or name.startswith("docsample_"):
                del sys.modules[name]


READERS_PACKAGES = {"payments", "orders", "billing", "myproject"}


def defined_here(module: types.ModuleType) -> Iterator[tuple[str, Any]]:
    for name, value in vars(module).items():
        if getattr(value, "__module__", None) == module.__name__:
            yield name, value


def build_policies(module: types.ModuleType) -> None:
    """Every idempotent view of the module turns its options into a policy, as a request would."""
    for _, value in defined_here(module):
        if isinstance(value, type) and issubclass(value, IdempotentMixin):
            request = RequestFactory().post("/")
            request.user = AnonymousUser()
            view = value()
            view.setup(request)
            view.get_idempotency_policy()


def routed(*patterns: Any) -> Any:
    """``override_settings`` for a URLconf of ``patterns``."""
    urls = types.ModuleType("docsample_urls")
    urls.urlpatterns = list(patterns)  # type: ignore[attr-defined]
    sys.modules[urls.__name__] = urls
    clear_url_caches()
    return override_settings(ROOT_URLCONF=urls.__name__)


EXERCISES: dict[tuple[str, str], Callable[..., None]] = {}


def exercise(page: str, name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register how a block that defines ``name`` on ``page`` is used once it ran."""

    def register(function: Callable[..., None]) -> Callable[..., None]:
        EXERCISES[(page, name)] = function
        return function

    return register


def defines_tests(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
        for node in tree.body
    )


# --- the test ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def readers_project() -> None:
    docs_project.install()


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize("block", params())
def test_every_python_block_runs(block: Block, client: Client, ledger: str, request: Any) -> None:
    try:
        tree = ast.parse(block.code)
    except SyntaxError as error:
        pytest.fail(f"{block.where}: not Python ({error}); mark it <!-- fragment --> if it is not")
    try:
        if defines_tests(tree):
            request.getfixturevalue("sample_tests")(block)
            return
        with readers_files(block, ledger):
            if is_settings(tree):
                run_settings(block, client)
                return
            module = run_code(block, ledger)
            build_policies(module)
            for (page, name), function in EXERCISES.items():
                if page == block.page and name in vars(module):
                    function(module, client=client, ledger=ledger)
    except Exception as error:
        raise AssertionError(
            f"{block.where} does not run: {type(error).__name__}: {error}; "
            "fix the sample, or mark it <!-- fragment --> if it cannot run alone"
        ) from error


def test_the_blocks_are_found():
    found = list(blocks())
    assert len(found) > 100
    assert any(block.fragment for block in found)
    assert {block.page for block in found} >= {"README.md", "docs/views.md", "docs/settings.md"}


def test_a_fragment_marker_must_be_right_before_the_fence(tmp_path):
    assert FRAGMENT.match("<!-- fragment -->")
    assert FRAGMENT.match("<!-- fragment continues the block above -->")
    assert not FRAGMENT.match("<!-- fragmentary -->")


SAMPLES_CONFTEST = """
import pytest


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    from django.conf import settings

    from tests import docs_project

    docs_project.install(api=True)
    settings.ROOT_URLCONF = "tests.docs_project"
"""


def sample_file(block: Block) -> str:
    return "test_" + re.sub(r"\W", "_", block.where) + ".py"


@pytest.fixture(scope="session")
def sample_test_results(tmp_path_factory: Any) -> dict[str, list[tuple[str, str]]]:
    """Runs every block that defines tests in one pytest process; (test, outcome) by file."""
    directory = tmp_path_factory.mktemp("samples")
    (directory / "conftest.py").write_text(SAMPLES_CONFTEST)
    for block in blocks():
        if block.page in PENDING_PAGES or block.fragment:
            continue
        try:
            if defines_tests(ast.parse(block.code)):
                (directory / sample_file(block)).write_text(block.code)
        except SyntaxError:
            continue
    report = directory / "report.xml"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    for name in ("TEST_PG_NAME", "TEST_MARIADB_NAME"):  # a test database of its own
        env[name] = os.environ.get(name, "django_idempotency") + "_samples"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--create-db",
            f"--junitxml={report}",
            str(directory),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,  # the report says which sample failed
    )
    assert report.exists(), process.stdout[-3000:] + process.stderr[-3000:]
    results: dict[str, list[tuple[str, str]]] = {}
    for case in ElementTree.parse(report).iter("testcase"):  # noqa: S314  (our own report)
        outcome = next((child.tag for child in case), "passed")
        details = "".join(child.get("message", "") for child in case)
        file = case.get("classname", "").rpartition(".")[2] + ".py"
        results.setdefault(file, []).append((case.get("name", ""), f"{outcome} {details}".strip()))
    return results


@pytest.fixture
def sample_tests(sample_test_results: dict[str, list[tuple[str, str]]]) -> Callable[[Block], None]:
    def run(block: Block) -> None:
        outcomes = sample_test_results.get(sample_file(block))
        assert outcomes, f"{block.where}: its tests did not run"
        failed = [(name, outcome) for name, outcome in outcomes if outcome != "passed"]
        assert not failed, failed

    return run
