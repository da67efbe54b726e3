"""The public API: the names the project promises to keep, and the docs that show no others.

``PUBLIC`` is the promise, written out once more on purpose: removing or renaming a public name
fails here, and so does adding one to a module's ``__all__`` without deciding that it is public
(and listing it in docs/api.md). Every name the docs show users, by import or by dotted path,
must resolve and be public: the package's layout may change, but what a user's code, settings
and logging configuration name must keep working, and a page that showed a private name would
teach users to depend on it. The names are read from the docs themselves, so a page that shows a
new one is guarded too.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API_PAGE = ROOT / "docs" / "api.md"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Not the changelog: it tells what each name was when it changed.
PAGES = [page for page in PAGES if page.name != "changelog.md"]

FROM_IMPORT = re.compile(
    r"^\s*from (django_idempotency(?:\.\w+)*) import \(?([\w, \n]+?)\)?\s*$", re.MULTILINE
)
# A dotted name in code or in a setting: `django_idempotency.x.Y` or "django_idempotency.x.y".
DOTTED = re.compile(r"[`\"'](django_idempotency(?:\.\w+)+)(?:\(\))?[`\"']")
# Check ids (E001) and the package's Celery task names are not import paths.
CHECK_ID = re.compile(r"django_idempotency\.[EW]\d{3}")
TASK_NAMES = set(
    re.findall(
        r'@task\("(django_idempotency\.\w+)"', (ROOT / "django_idempotency/tasks.py").read_text()
    )
)

PUBLIC: dict[str, set[str]] = {
    "admin": {"CappedPaginator", "IdempotencyKeyAdmin", "InboxEventAdmin", "OutboxMessageAdmin"},
    "backoff": {"decorrelated_jitter", "equal_jitter", "full_jitter"},
    "brokers": {"BrokerDispatcher", "MessageConsumer", "consume", "handle"},
    "celery": {"idempotent_task"},
    "client": {
        "AsyncRetryTransport",
        "CircuitBreaker",
        "CircuitBreakers",
        "CircuitOpen",
        "RETRYABLE_STATUSES",
        "RetryAdapter",
        "RetryBudget",
        "RetryBudgets",
        "RetryPolicy",
        "RetryTransport",
        "retrying_async_client",
        "retrying_client",
        "retrying_session",
    },
    "conditional": {"PreconditionError", "etag_for_content", "etag_for_version"},
    "correlation": {"CorrelationIdFilter", "CorrelationIdMiddleware", "get_correlation_id"},
    "decorators": {"conditional", "idempotent"},
    "drf": {"ConditionalMixin", "IdempotentMixin", "JSONParser"},
    "drf_errors": {"DependencyTimeout", "DependencyUnavailable", "problem_exception_handler"},
    "engine": {"Engine"},
    "django_tasks": {"idempotent_task"},
    "django_tasks.lifecycle": {
        "dispatch_due_inbox_events",
        "process_inbox_event",
        "purge_dispatched_outbox_messages",
        "purge_expired_keys",
        "purge_processed_inbox_events",
        "relay_outbox",
        "sweep_expired_leases",
    },
    "exceptions": {
        "PermanentError",
        "TaskInProgress",
        "TaskKeyInvalid",
        "TaskKeyMissing",
        "TaskPayloadMismatch",
    },
    "guard": {"RetryGuardMiddleware", "current", "remaining", "retries_allowed"},
    "inbox": {
        "ANY_TYPE",
        "ProcessResult",
        "Receipt",
        "Verifier",
        "WebhookReceiverView",
        "dispatch_due",
        "inbox_handler",
        "mark_dead",
        "process",
        "receive",
        "register_handler",
        "reprocess",
        "retry_now",
    },
    "keys": {"InvalidKey", "ScopedKey", "downstream_key", "key_of"},
    "metrics": {"register_database_gauges"},
    "models": {"IdempotencyKey", "InboxEvent", "OutboxMessage"},
    "ninja": {"idempotency_extra", "idempotent", "ninja_scope", "principal"},
    "openapi": {"IdempotencySchemaExtension", "document"},
    "outbox": {
        "ANY_TOPIC",
        "CeleryTaskDispatcher",
        "DispatchError",
        "PermanentDispatchError",
        "RelayResult",
        "WebhookDispatcher",
        "envelope",
        "outbox_dispatcher",
        "publish",
        "redeliver",
        "register_dispatcher",
        "relay",
    },
    "policy": {"Policy", "ViewOptions"},
    "problems": {"PROBLEM_MEDIA_TYPE", "Problem"},
    "reconcile": {"ExpiredKey", "NothingHappened", "Reconciled", "SweepResult", "Unknown"},
    "scope": {"AnonymousRejected", "default_scope", "get_principal"},
    "signals": {
        "DECISION_SIGNALS",
        "database_unavailable",
        "inbox_delivery_refused",
        "inbox_event_dead",
        "inbox_event_duplicate",
        "inbox_event_failed",
        "inbox_event_processed",
        "inbox_event_received",
        "key_invalid",
        "key_missing",
        "key_replayed",
        "key_stored",
        "lease_renewed",
        "lease_taken_over",
        "payload_mismatch",
        "replay_cache_failed",
        "request_in_progress",
        "response_not_stored",
        "task_decided",
    },
    "signing": {
        "GitHubSignature",
        "HMACVerifier",
        "SignatureError",
        "StandardWebhooksSignature",
        "StripeSignature",
    },
    "store": {"replay_counts"},
    "tasks": {
        "dispatch_due_inbox_events",
        "process_inbox_event",
        "purge_dispatched_outbox_messages",
        "purge_expired_keys",
        "purge_processed_inbox_events",
        "relay_outbox",
        "sweep_expired_leases",
    },
    "testing": {"IdempotentAPIClient", "assert_idempotent", "idempotency_disabled"},
}


# Paths kept for a while under the deprecation policy: module -> {name: the name's one home}.
# Each warns, still works, and is listed on the API page with the release that removes it.
DEPRECATED: dict[str, dict[str, str]] = {
    "celery": {
        "TaskInProgress": "exceptions",
        "TaskKeyInvalid": "exceptions",
        "TaskKeyMissing": "exceptions",
        "TaskPayloadMismatch": "exceptions",
    },
    "inbox": {
        "GitHubSignature": "signing",
        "HMACVerifier": "signing",
        "PermanentError": "exceptions",
        "SignatureError": "signing",
        "StandardWebhooksSignature": "signing",
        "StripeSignature": "signing",
    },
    "ninja": {"PROBLEM_MEDIA_TYPE": "problems"},
    "openapi": {"PROBLEM_MEDIA_TYPE": "problems"},
    "outbox": {"PermanentError": "exceptions"},
}


def _deprecated_paths() -> set[str]:
    # Shown on the API page as what not to import: their own test checks them.
    return {
        f"django_idempotency.{module}.{name}"
        for module, names in DEPRECATED.items()
        for name in names
    }


def _imports() -> set[tuple[str, str]]:
    found = set()
    for page in PAGES:
        for module, names in FROM_IMPORT.findall(page.read_text()):
            for name in names.replace("\n", " ").split(","):
                if name := name.strip().split(" as ")[0]:
                    found.add((module, name))
    return found


def _dotted() -> set[str]:
    found = set()
    for page in PAGES:
        for path in DOTTED.findall(page.read_text()):
            if not CHECK_ID.fullmatch(path) and path not in TASK_NAMES | _deprecated_paths():
                found.add(path)
    return found


def _resolve(path: str) -> object:
    """The module, or the attribute of the longest module prefix, that ``path`` names."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(path)


def test_the_docs_show_names_to_check():
    # The patterns still find what the pages show.
    assert ("django_idempotency.drf", "IdempotentMixin") in _imports()
    assert "django_idempotency.correlation.CorrelationIdMiddleware" in _dotted()
    assert "django_idempotency.backoff" in _dotted()
    assert "django_idempotency.purge_expired_keys" in TASK_NAMES


@pytest.mark.parametrize(("module", "name"), sorted(_imports()))
def test_every_name_the_docs_import_resolves(module, name):
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("path", sorted(_dotted()))
def test_every_dotted_name_the_docs_show_resolves(path):
    assert _resolve(path) is not None


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_module_exports_what_is_promised_and_nothing_else(module):
    imported = importlib.import_module(f"django_idempotency.{module}")
    assert set(imported.__all__) == PUBLIC[module]
    for name in imported.__all__:
        assert hasattr(imported, name), f"django_idempotency.{module}.{name} is gone"


def test_the_api_page_lists_every_public_module_and_name():
    page = API_PAGE.read_text()
    for module, names in PUBLIC.items():
        assert f"`django_idempotency.{module}`" in page, module
        for name in names:
            assert re.search(rf"`{re.escape(name)}`", page), f"{module}.{name}"


def _public(module: str, name: str | None) -> bool:
    if module == "django_idempotency":  # from django_idempotency import signals
        return name in PUBLIC
    short = module.removeprefix("django_idempotency.")
    return short in PUBLIC and (name is None or name in PUBLIC[short])


@pytest.mark.parametrize(("module", "name"), sorted(_imports()))
def test_every_name_the_docs_import_is_public(module, name):
    assert _public(module, name), f"the docs import a private name: {module}.{name}"


@pytest.mark.parametrize("path", sorted(_dotted()))
def test_every_dotted_name_the_docs_show_is_public(path):
    parts = path.removeprefix("django_idempotency.").split(".")
    # The longest prefix that is a public module (django_tasks.lifecycle, say), else the first.
    split = max(
        (count for count in range(1, len(parts) + 1) if ".".join(parts[:count]) in PUBLIC),
        default=1,
    )
    module, rest = ".".join(parts[:split]), parts[split:]
    assert _public(module, rest[0] if rest else None), f"the docs show a private name: {path}"


@pytest.mark.parametrize(
    ("module", "name", "home"),
    [(module, name, home) for module, names in DEPRECATED.items() for name, home in names.items()],
)
def test_each_deprecated_path_warns_and_still_works(module, name, home):
    imported = importlib.import_module(f"django_idempotency.{module}")
    new_home = f"django_idempotency.{home}"
    with pytest.warns(DeprecationWarning, match=rf"import it from {re.escape(new_home)}") as caught:
        value = getattr(imported, name)
    assert value is getattr(importlib.import_module(new_home), name)
    assert name in PUBLIC[home]
    assert name not in imported.__all__
    assert "1.2" in str(caught[0].message)
    assert caught[0].filename == __file__  # the warning points at the code that uses the path
    row = f"| `django_idempotency.{module}.{name}` | `django_idempotency.{home}.{name}` | 1.2 |"
    assert row in API_PAGE.read_text()


def test_a_deprecated_module_answers_no_other_name():
    with pytest.raises(AttributeError, match="no_such_name"):
        importlib.import_module("django_idempotency.inbox").no_such_name  # noqa: B018


def test_each_public_name_has_one_home():
    homes: dict[tuple[str, int], set[str]] = {}
    for module, names in PUBLIC.items():
        imported = importlib.import_module(f"django_idempotency.{module}")
        for name in names:
            homes.setdefault((name, id(getattr(imported, name))), set()).add(module)
    # Two objects under one name (decorators.idempotent and ninja.idempotent) are two names.
    shared = {name: modules for (name, _), modules in homes.items() if len(modules) > 1}
    assert shared == {}
