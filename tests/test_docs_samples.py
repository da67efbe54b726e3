"""Every ```python block of README.md and docs/*.md runs here, or is marked as a fragment.

How a block runs depends on what it is:

- **Settings** (only ``NAME = value`` assignments in capitals, and imports): the values are put in
  place with ``override_settings`` and proved by what reads them: the library's system checks (no
  error or warning of ours) for every settings block, a request through the ``MIDDLEWARE``,
  Django's cache handler for ``CACHES``, DRF's settings for ``REST_FRAMEWORK``, ``dictConfig`` and
  a log record in a fresh process for ``LOGGING``, the app registry for ``INSTALLED_APPS``, the
  backend for ``DATABASES``, Celery's registered tasks and their signatures for
  ``CELERY_BEAT_SCHEDULE``. A settings block runs as a settings module that already has
  ``from datetime import timedelta``, as the settings page's first example does; ``...`` in a list
  or as a dict value stands for the reader's other entries and is left out.
- **Tests** (a block that defines ``test_*`` functions): they run with pytest, in one subprocess
  for all such blocks, against the reader's payments API of ``tests/docs_project.py``.
- **Code** (anything else): it runs as a throwaway module, with the reader's own names
  (``Payment``, ``PaymentSerializer``, ``provider``..., see ``tests/docs_project.py``) given and
  nothing of the library's, Django's or Python's. A block whose first line is
  ``# package/module.py`` is that module: its relative imports work, and other blocks (and dotted
  paths in settings) import it by that name. ``async with``/``await`` at the top level run in an
  event loop, and ``https://ledger.example.com`` and ``https://billing.example.com`` are a live
  local server. Every ``IdempotentMixin``
  view it defines must set only the mixin's options and turn them into a policy; the blocks listed
  in ``EXERCISES`` are then used as a reader would: views called over HTTP with the test client
  (the retry replays), app configs made ready, client responses read.

A block that cannot run alone (it continues the block above it, or shows a signature or a
placeholder) is marked with an HTML comment, invisible on the rendered page, on the line right
before its fence, with an optional reason::

    <!-- fragment -->
    ```python

    <!-- fragment: it continues the block above -->
    ```python

A block that neither runs nor is marked fails, naming its file and line.
"""

from __future__ import annotations

import ast
import asyncio
import base64
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
import uuid
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
from django.contrib.auth.models import AnonymousUser, User
from django.core.cache import caches
from django.core.checks import Warning as CheckWarning
from django.core.checks import run_checks
from django.db import connection
from django.db.utils import load_backend
from django.http import JsonResponse
from django.test import Client, override_settings
from django.test.client import RequestFactory
from django.urls import clear_url_caches, path
from django.utils import timezone
from django.utils.module_loading import import_string
from django.views.decorators.csrf import csrf_exempt
from rest_framework.decorators import api_view, permission_classes
from rest_framework.settings import api_settings

from django_idempotency import signals
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.inbox import handlers, inbox_handler
from django_idempotency.models import IdempotencyKey, OutboxMessage
from django_idempotency.operations.checks import MARIADB_JSON_DEPTH
from django_idempotency.outbox import dispatchers
from django_idempotency.reconcile import ExpiredKey, NothingHappened, Reconciled, Unknown
from django_idempotency.signing import StripeSignature
from tests import docs_project
from tests.factories import UserFactory
from tests.testapp.models import LedgerEntry, Payment, Refund

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = re.compile(r"^<!-- fragment(?:: [^>]*)? -->$")
FENCE = re.compile(r"^```python\s*$")
HEADER = re.compile(r"^# ([\w/]+)\.py\b")
# The services the samples call: each is the local ledger server while a sample runs.
EXAMPLE_HOSTS = re.compile(r"https://(?:ledger|billing)\.example\.com")


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the fence's line, 1-based
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(pages: list[Path] = PAGES, root: Path = ROOT) -> Iterator[Block]:
    for page in pages:
        if page.is_symlink():  # docs/changelog.md is CHANGELOG.md
            continue
        lines = page.read_text().splitlines()
        name = page.relative_to(root).as_posix()
        index = 0
        while index < len(lines):
            if FENCE.match(lines[index]):
                end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
                fragment = index > 0 and bool(FRAGMENT.match(lines[index - 1]))
                code = "\n".join(lines[index + 1 : end]) + "\n"
                yield Block(name, index + 1, code, fragment)
                index = end
            index += 1


def commits(block: Block) -> bool:
    """Lease mode commits the key before the view runs, and some exercises need their commits
    (the inbox processes an event once it is recorded): not inside a test's transaction."""
    return bool(re.search(r"""mode\s*=\s*["']lease""", block.code)) or any(
        page == block.page and excerpt in block.code for page, excerpt in COMMITTING_EXERCISES
    )


def params(*, committing: bool = False) -> list[Any]:
    found = []
    for block in blocks():
        if commits(block) != committing:
            continue
        marks = []
        if block.fragment:
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
        # No database: from Django 6.1 the model checks would otherwise ask each one what it
        # supports, and a test may not reach them all.
        for message in run_checks(databases=[])
        if message.id and message.id.startswith("django_idempotency.")
    ]


def prove_idempotency(value: dict[str, Any], client: Client) -> None:
    messages = our_messages()
    if value.get("MAX_JSON_DEPTH", 0) > MARIADB_JSON_DEPTH and connection.vendor == "mysql":
        # A sample for PostgreSQL only: on MariaDB it must get the warning that says so.
        assert "django_idempotency.W007" in [message.id for message in messages], messages
        messages = [message for message in messages if message.id != "django_idempotency.W007"]
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
        engine = database["ENGINE"]
        if engine == "django.db.backends.mysql" and importlib.util.find_spec("MySQLdb") is None:
            # Its driver is the mariadb extra's, which the tests do not need: the name is real.
            assert importlib.util.find_spec(f"{engine}.base") is not None
            continue
        load_backend(engine)


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


def prove_beat_schedule(value: dict[str, Any], client: Client) -> None:
    # Celery is optional: imported when a sample asks for it.
    from celery import schedules  # noqa: PLC0415

    from tests.celery_app import app  # noqa: PLC0415

    app.loader.import_default_modules()
    for entry in value.values():
        task = app.tasks[entry["task"]]  # a task of ours, by its registered name
        inspect.signature(task.run).bind(*entry.get("args", ()), **entry.get("kwargs", {}))
        assert isinstance(entry["schedule"], timedelta | int | float | schedules.schedule)


def prove_tasks(value: dict[str, Any], client: Client) -> None:
    for alias, backend in value.items():
        path = backend["BACKEND"]
        if importlib.util.find_spec("django.tasks") is None:
            # Before Django 6.0 the backport has the same backends, as the page says.
            path = path.replace("django.tasks.", "django_tasks.", 1)
        backend_class = import_string(path)
        assert list(backend_class(alias=alias, params=backend).check()) == []


PROVE: dict[str, Callable[[Any, Client], None]] = {
    "CELERY_BEAT_SCHEDULE": prove_beat_schedule,
    "TASKS": prove_tasks,
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
    code = compile(block.code, block.where, "exec", dont_inherit=True)
    exec(code, namespace)  # noqa: S102  (the docs' own samples)
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
    if "IDEMPOTENCY" in overrides:
        # A block shows the keys it is about; the project keeps its others (its namespace).
        overrides["IDEMPOTENCY"] = {**settings.IDEMPOTENCY, **overrides["IDEMPOTENCY"]}
    # Settings that a test process must keep as they are are proved without being put in place.
    for name in ("INSTALLED_APPS", "DATABASES", "LOGGING", "TASKS"):
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
        EXAMPLE_HOSTS.sub(ledger, block.code),
        block.where,
        "exec",
        dont_inherit=True,
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
            if name and not block.fragment:
                self.files.setdefault(name, []).append(block)

    def find_spec(self, fullname: str, search: Any, target: Any = None) -> Any:
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
        source = EXAMPLE_HOSTS.sub(self.ledger, block.code)
        code = compile(source, block.where, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102  (the docs' own samples)


@contextmanager
def readers_files(block: Block, ledger: str) -> Iterator[None]:
    """The docs' files importable while ``block`` runs; the registries as they were after it."""
    finder = DocsFiles(block, ledger)
    modules = set(sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        with (
            # The reader's project has its own handlers and dispatchers, not the test app's.
            mock.patch.dict(dispatchers._registry, clear=True),
            mock.patch.dict(handlers._registry, clear=True),
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
            unknown = [
                name
                for name in vars(value)
                if name.startswith("idempotency_") and not hasattr(IdempotentMixin, name)
            ]
            assert not unknown, f"{value.__name__} sets no option of the mixin: {unknown}"
            for user in (AnonymousUser(), User(username="staff", is_staff=True)):
                request = RequestFactory().post("/")
                request.user = user
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


EXERCISES: dict[tuple[str, str], Callable[[types.ModuleType, Client], None]] = {}


COMMITTING_EXERCISES: set[tuple[str, str]] = set()


def exercise(
    page: str, excerpt: str, *, committing: bool = False
) -> Callable[[Callable[[types.ModuleType, Client], None]], Callable[..., None]]:
    """Register how the block of ``page`` whose code holds ``excerpt`` is used once it ran;
    ``committing`` if it needs its transactions to commit."""

    def register(function: Callable[[types.ModuleType, Client], None]) -> Callable[..., None]:
        EXERCISES[(page, excerpt)] = function
        if committing:
            COMMITTING_EXERCISES.add((page, excerpt))
        return function

    return register


def basic_auth() -> dict[str, str]:
    user = UserFactory()
    token = base64.b64encode(f"{user.username}:password".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def post_twice(
    client: Client, url: str, data: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[Any, Any]:
    """A POST and its retry with the same key: the first is stored, the retry replays it."""
    headers = {**(headers or {}), "Idempotency-Key": str(uuid.uuid4())}
    first, retry = (
        client.post(url, data, content_type="application/json", headers=headers) for _ in "12"
    )
    assert first.status_code == 201, first.content
    assert first["Idempotency-Status"] == "stored"
    assert retry["Idempotency-Status"] == "replayed"
    assert retry.content == first.content
    return first, retry


@exercise("README.md", "class PaymentCreateView(")
def readme_create_view(module: types.ModuleType, client: Client) -> None:
    with routed(path("payments/", module.PaymentCreateView.as_view())):
        post_twice(client, "/payments/", {"amount": 500, "currency": "EUR"}, basic_auth())
    assert Payment.objects.count() == 1


@exercise("README.md", 'publish("order.paid"')
def readme_publish(module: types.ModuleType, client: Client) -> None:
    (message,) = OutboxMessage.objects.all()
    assert (message.topic, message.payload, message.ordering_key) == (
        "order.paid",
        {"order": 7},
        "order-7",
    )


@exercise("docs/outbox.md", "def mark_paid(order):")
def outbox_mark_paid(module: types.ModuleType, client: Client) -> None:
    order = docs_project.Order(pk=42, amount_cents=990)
    module.mark_paid(order)
    (message,) = OutboxMessage.objects.all()
    assert (message.topic, message.payload, message.ordering_key) == (
        "order.paid",
        {"order_id": 42, "amount_cents": 990},
        "order-42",
    )
    assert order.status == "paid"


@exercise("docs/quickstart.md", "urlpatterns = [")
def quickstart_urls(module: types.ModuleType, client: Client) -> None:
    with routed(*module.urlpatterns):
        post_twice(client, "/api/payments/", {"amount": 1000, "currency": "EUR"}, basic_auth())
    assert Payment.objects.count() == 1


@exercise("docs/quickstart.md", "def create_payment(request):")
def quickstart_plain_view(module: types.ModuleType, client: Client) -> None:
    with routed(path("payments/", module.create_payment)):
        first, _ = post_twice(client, "/payments/", {"amount": 1000, "currency": "EUR"})
    assert first.json() == {"id": Payment.objects.get().pk, "amount": 1000}


@exercise("docs/views.md", "async def create_payment(request):")
def async_view(module: types.ModuleType, client: Client) -> None:
    with routed(path("payments/", module.create_payment)):
        post_twice(client, "/payments/", {"amount": 1000})
    assert Payment.objects.count() == 1


@exercise("docs/concepts.md", "class ChargeView(")
def lease_view(module: types.ModuleType, client: Client) -> None:
    with routed(path("charges/", module.ChargeView.as_view())):
        first, _ = post_twice(client, "/charges/", {"amount": 700}, basic_auth())
    assert first.json()["charge"] in {
        charge.id for charge in docs_project.provider.charges.values()
    }


@exercise("docs/views.md", "def tenant_scope(request, route):")
def tenant_scope(module: types.ModuleType, client: Client) -> None:
    @csrf_exempt
    @idempotent(scope_function=module.tenant_scope)
    def create_payment(request: Any, tenant: str) -> JsonResponse:
        return JsonResponse({"tenant": tenant}, status=201)

    with routed(path("t/<slug:tenant>/payments/", create_payment)):
        post_twice(client, "/t/acme/payments/", {"amount": 1})
    (key,) = IdempotencyKey.objects.all()
    assert key.scope == "anonymous tenant:acme POST t/<slug:tenant>/payments/", key.scope


@exercise("docs/errors.md", "class CardDeclined(")
def own_problem(module: types.ModuleType, client: Client) -> None:
    @api_view(["POST"])
    @permission_classes([])
    def pay(request: Any) -> None:
        raise module.CardDeclined

    handler = "django_idempotency.drf_errors.problem_exception_handler"
    rest_framework = {**settings.REST_FRAMEWORK, "EXCEPTION_HANDLER": handler}
    with routed(path("pay/", pay)), override_settings(REST_FRAMEWORK=rest_framework):
        response = client.post("/pay/")
    assert response.status_code == 402
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "payment.card_declined"


@exercise("docs/ninja.md", "def create_payment(request, payload: PaymentIn):")
def ninja_view(module: types.ModuleType, client: Client) -> None:
    client.force_login(UserFactory())
    with routed(path("api/", module.api.urls)):
        first, _ = post_twice(client, "/api/payments/", {"amount": 5, "currency": "EUR"})
    assert first.json() == {"id": Payment.objects.get().pk, "amount": 5, "currency": "EUR"}
    assert LedgerEntry.objects.count() == 1


@exercise("docs/observability.md", "def metrics(request):")
def metrics_view(module: types.ModuleType, client: Client) -> None:
    with routed(path("metrics/", module.metrics)):
        response = client.get("/metrics/")
    assert response.status_code == 200
    assert b"idempotency" in response.content


@exercise("docs/observability.md", "def private_metrics(request):")
def private_metrics_view(module: types.ModuleType, client: Client) -> None:
    with routed(path("metrics/", module.private_metrics)), override_settings(METRICS_TOKEN="t0k"):
        assert client.get("/metrics/").status_code == 403
        assert client.get("/metrics/", headers={"Authorization": "Bearer nope"}).status_code == 403
        scraped = client.get("/metrics/", headers={"Authorization": "Bearer t0k"})
        assert scraped.status_code == 200
        assert b"idempotency" in scraped.content
        client.force_login(UserFactory(is_staff=True))
        assert client.get("/metrics/").status_code == 200


@exercise("docs/observability.md", "class PaymentsConfig(")
@exercise("docs/outbox.md", "class OrdersConfig(")
def app_config_ready(module: types.ModuleType, client: Client) -> None:
    receivers = signals.payload_mismatch.receivers[:]
    registered = dict(dispatchers._registry)
    config = next(value for _, value in defined_here(module) if isinstance(value, type))
    config.ready(None)  # imports the module it names: the docs show that module too
    assert (dispatchers._registry, signals.payload_mismatch.receivers) != (registered, receivers)


@exercise("docs/client.md", "with retrying_client(")
@exercise("docs/client.md", "async with retrying_async_client(")
@exercise("docs/client.md", "with retrying_session(")
def client_response(module: types.ModuleType, client: Client) -> None:
    assert module.response.status_code == 200  # from the local ledger service
    assert module.response.json()["path"].startswith("/")


@exercise("docs/inbox.md", "signer.sign(body", committing=True)
def signed_delivery(module: types.ModuleType, client: Client) -> None:
    """The quick start's receiver processes the delivery; the same again is a duplicate."""
    webhooks = importlib.import_module("billing.webhooks")
    handled: list[Any] = []
    inbox_handler("orders", "order.paid")(handled.append)
    headers = {name: value for name, value in module.headers.items() if name != "Content-Type"}
    answers: list[tuple[int, Any]] = []
    with (
        routed(path("webhooks/orders/", webhooks.OrdersWebhook.as_view())),
        override_settings(ORDERS_WEBHOOK_SECRETS=[docs_project.WEBHOOK_SECRET]),
    ):
        for _ in "12":
            response = client.post(
                "/webhooks/orders/",
                module.body,
                content_type="application/json",
                headers=headers,
            )
            answers.append((response.status_code, response.json()))
    assert answers == [(200, {"status": "processed"}), (200, {"status": "duplicate"})]
    (event,) = handled
    assert (event.source, event.event_id, event.event_type) == ("orders", "evt_1042", "order.paid")


@exercise("docs/operations.md", "def ask_the_provider(expired: ExpiredKey)")
def reconcile_hook(module: types.ModuleType, client: Client) -> None:
    """The hook answers each of its three results, as the provider's charge says."""
    # The view charged with the key's downstream key, as the docs tell it to.
    charged = ExpiredKey("anonymous", "key-charged", "payments/", "POST", "", 1, timezone.now())
    charge = docs_project.provider.charge(700, idempotency_key=charged.downstream_key)

    def ask(key: str) -> Any:
        expired = ExpiredKey("anonymous", key, "payments/", "POST", "", 1, timezone.now())
        return module.ask_the_provider(expired)

    answer = ask("key-charged")
    assert isinstance(answer, Reconciled)
    assert answer.stored() == (
        [("Content-Type", "application/json")],
        json.dumps({"id": charge.id, "amount": 700}).encode(),
    )
    assert answer.status == 201
    assert isinstance(ask("key-never-charged"), NothingHappened)
    unavailable = docs_project.Provider.Unavailable
    with mock.patch.object(docs_project.provider, "find_charge", side_effect=unavailable):
        assert isinstance(ask("key-charged"), Unknown)


@exercise("docs/recipes.md", "class ChargeView(")
def recipe_charge(module: types.ModuleType, client: Client) -> None:
    """The answer to a charge is lost; the retry's recovery hook finds it and records it once."""
    provider = docs_project.provider
    charge = provider.charge

    def charged_then_lost(*args: Any, **kwargs: Any) -> Any:
        charge(*args, **kwargs)
        raise provider.Timeout

    charges = len(provider.charges)
    headers = {**basic_auth(), "Idempotency-Key": str(uuid.uuid4())}

    def pay(client: Client) -> Any:
        return client.post(
            "/charges/", {"amount": 700}, content_type="application/json", headers=headers
        )

    with routed(path("charges/", module.ChargeView.as_view())):
        with mock.patch.object(provider, "charge", charged_then_lost):
            assert pay(Client(raise_request_exception=False)).status_code == 500
        assert Payment.objects.count() == 0  # rolled back with the failed attempt
        with mock.patch.object(provider, "charge", wraps=charge) as charging:
            recovered, replayed = pay(client), pay(client)
        charging.assert_not_called()  # the recovery hook found the charge
        assert recovered.status_code == 201, recovered.content
        assert replayed["Idempotency-Status"] == "replayed"
        assert replayed.content == recovered.content
        post_twice(client, "/charges/", {"amount": 300}, basic_auth())  # no failure: post()
    assert len(provider.charges) == charges + 2
    payment = Payment.objects.get(amount=700)
    assert recovered.json() == {"payment": payment.pk, "charge": payment.reference}
    assert Payment.objects.count() == 2


@exercise("docs/recipes.md", "class StripeWebhook(", committing=True)
def recipe_stripe(module: types.ModuleType, client: Client) -> None:
    """A signed Stripe event is processed once; its second delivery is a duplicate."""
    secret = "whsec_tests-only-stripe-secret"
    body = json.dumps(
        {
            "id": "evt_1",
            "type": "charge.refunded",
            "data": {"object": {"id": "ch_1", "amount_refunded": 250}},
        }
    )
    headers = StripeSignature(secret).sign(body.encode())
    answers = []
    with (
        routed(path("webhooks/stripe/", module.StripeWebhook.as_view())),
        override_settings(STRIPE_WEBHOOK_SECRETS=[secret]),
    ):
        for _ in "12":
            response = client.post(
                "/webhooks/stripe/", body, content_type="application/json", headers=headers
            )
            answers.append((response.status_code, response.json()))
    assert answers == [(200, {"status": "processed"}), (200, {"status": "duplicate"})]
    (refund,) = Refund.objects.all()
    assert (refund.event_id, refund.amount) == ("evt_1", 250)


@exercise("docs/recipes.md", '@outbox_dispatcher("payment.created")', committing=True)
def recipe_outbox(module: types.ModuleType, client: Client) -> None:
    """The payment and its message commit together, the message is dispatched once, and the
    replay publishes nothing."""
    sent = len(module.ledger.sent)
    with routed(path("payments/", module.PaymentCreateView.as_view())):
        first, _ = post_twice(client, "/payments/", {"amount": 300}, basic_auth())
    (message,) = OutboxMessage.objects.all()
    assert message.status == "dispatched"
    payload = {"payment": first.json()["id"], "amount": 300}
    assert module.ledger.sent[sent:] == [
        ("payment.created", payload, {"idempotency_key": str(message.message_id)})
    ]


@exercise("docs/recipes.md", "def record_in_ledger(payment_id):")
def recipe_task(module: types.ModuleType, client: Client) -> None:
    payment = Payment.objects.create(amount=400)
    results = [module.record_in_ledger.apply((payment.pk,)).get() for _ in "12"]
    (entry,) = LedgerEntry.objects.all()
    assert results == [{"payment": payment.pk, "entry": entry.pk}] * 2
    assert entry.amount == 400


@exercise("docs/recipes.md", "def tenant_scope(request, route):")
def recipe_tenant_scope(module: types.ModuleType, client: Client) -> None:
    """Without the tenant in the scope, a second tenant gets the first one's answer."""

    @csrf_exempt
    def create_payment(request: Any) -> JsonResponse:
        return JsonResponse({"tenant": request.headers["X-Tenant"]}, status=201)

    def answers(view: Any) -> list[Any]:
        key = str(uuid.uuid4())
        with routed(path("payments/", view)):
            return [
                client.post(
                    "/payments/",
                    {"amount": 1},
                    content_type="application/json",
                    headers={"Idempotency-Key": key, "X-Tenant": tenant},
                ).json()
                for tenant in ("acme", "globex")
            ]

    assert answers(idempotent(create_payment)) == [{"tenant": "acme"}] * 2
    scoped = idempotent(scope_function=module.tenant_scope)(create_payment)
    assert answers(scoped) == [{"tenant": "acme"}, {"tenant": "globex"}]
    scopes = set(IdempotencyKey.objects.values_list("scope", flat=True))
    assert "anonymous tenant:globex POST payments/" in scopes, scopes


def defines_tests(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
        for node in tree.body
    )


# --- the test ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def readers_project() -> Iterator[None]:
    modules = set(sys.modules)
    docs_project.install()
    yield
    for name in set(sys.modules) - modules:
        if name.partition(".")[0] in READERS_PACKAGES:
            del sys.modules[name]


def run_block(block: Block, client: Client, ledger: str, request: Any) -> None:
    """Run ``block`` as its kind asks; fail naming its file and line if it does not run."""
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
            for (page, excerpt), function in EXERCISES.items():
                if page == block.page and excerpt in block.code:
                    function(module, client)
    except Exception as error:
        pytest.fail(
            f"{block.where} does not run: {type(error).__name__}: {error}; "
            "fix the sample, or mark it <!-- fragment --> if it cannot run alone"
        )


@pytest.mark.django_db
@pytest.mark.parametrize("block", params())
def test_every_python_block_runs(block: Block, client: Client, ledger: str, request: Any) -> None:
    run_block(block, client, ledger, request)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("block", params(committing=True))
def test_every_committing_python_block_runs(block, client, ledger, request):
    run_block(block, client, ledger, request)


def test_the_blocks_are_found():
    found = list(blocks())
    assert len(found) > 100
    assert any(block.fragment for block in found)
    assert {block.page for block in found} >= {"README.md", "docs/views.md", "docs/settings.md"}


@pytest.mark.parametrize(("page", "excerpt"), sorted(EXERCISES))
def test_every_exercise_finds_its_block(page, excerpt):
    assert [b for b in blocks() if b.page == page and excerpt in b.code and not b.fragment]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("from django_idempotency.drf import IdempotentMixn\n", "ImportError"),
        ('IDEMPOTENCY = {"TTL": -1}\n', "django_idempotency.E006"),
        ('IDEMPOTENCY = {"HEADER": "X-Key"}\nSPAM = 1\n', "no way to prove"),
        ("publish(topic, payload, *, headers=None)\n", "not Python"),
        (
            'CELERY_BEAT_SCHEDULE = {"purge": {"task": "django_idempotency.purge_expired_keys",'
            ' "schedule": 60, "kwargs": {"batch": 10}}}\n',
            "unexpected keyword argument 'batch'",
        ),
        (
            "from rest_framework.views import APIView\n"
            "from django_idempotency.drf import IdempotentMixin\n"
            "class V(IdempotentMixin, APIView):\n    idempotency_tll = 60\n",
            "idempotency_tll",
        ),
    ],
)
def test_a_block_that_does_not_run_fails_with_its_file_and_line(
    code, error, client, ledger, request
):
    block = Block("docs/example.md", 12, code, fragment=False)
    with pytest.raises(pytest.fail.Exception, match=rf"docs/example\.md:12(.|\n)*{error}"):
        run_block(block, client, ledger, request)


def test_a_fragment_is_marked_on_the_line_right_before_its_fence(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- fragment -->\n```python\nfirst = ...\n```\n\n"
        "<!-- fragment -->\n\n```python\nsecond = 2\n```\n\n"
        "<!-- fragmentary -->\n```python\nthird = 3\n```\n\n"
        "<!-- fragment: it continues the block above -->\n```python\nfourth = 4\n```\n"
    )
    assert [(b.line, b.code, b.fragment) for b in blocks([page], tmp_path)] == [
        (4, "first = ...\n", True),
        (10, "second = 2\n", False),
        (15, "third = 3\n", False),
        (20, "fourth = 4\n", True),
    ]


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
        if block.fragment:
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
