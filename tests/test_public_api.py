"""The public API: the names the project promises to keep, and the docs that name no others.

``PUBLIC`` is the promise, written out once more on purpose: removing or renaming a public name
fails here, and so does adding one without deciding that it is public (and listing it in
docs/api.md). The docs may import only public names: a page that shows a private one would teach
users to depend on it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
API_PAGE = ROOT / "docs" / "api.md"

PUBLIC: dict[str, set[str]] = {
    "admin": {"CappedPaginator", "IdempotencyKeyAdmin", "InboxEventAdmin", "OutboxMessageAdmin"},
    "backoff": {"decorrelated_jitter", "equal_jitter", "full_jitter"},
    "brokers": {"BrokerDispatcher", "MessageConsumer", "consume", "handle"},
    "celery": {
        "TaskInProgress",
        "TaskKeyInvalid",
        "TaskKeyMissing",
        "TaskPayloadMismatch",
        "idempotent_task",
    },
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
    "exceptions": {"PermanentError"},
    "guard": {"RetryGuardMiddleware", "current", "remaining", "retries_allowed"},
    "inbox": {
        "ANY_TYPE",
        "GitHubSignature",
        "HMACVerifier",
        "PermanentError",
        "ProcessResult",
        "Receipt",
        "SignatureError",
        "StandardWebhooksSignature",
        "StripeSignature",
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
    "ninja": {"PROBLEM_MEDIA_TYPE", "idempotency_extra", "idempotent", "ninja_scope", "principal"},
    "openapi": {"IdempotencySchemaExtension", "PROBLEM_MEDIA_TYPE", "document"},
    "outbox": {
        "ANY_TOPIC",
        "CeleryTaskDispatcher",
        "DispatchError",
        "PermanentDispatchError",
        "PermanentError",
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
    "problems": {"Problem"},
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
# Not modules: system check ids (django_idempotency.E001).
CHECK_ID = re.compile(r"[EW]\d{3}")
TASK_NAMES = PUBLIC["tasks"]  # Celery knows the tasks as django_idempotency.<name>


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
            assert re.search(rf"`{re.escape(name)}\b", page), f"{module}.{name}"


IMPORT = re.compile(r"from django_idempotency\.([\w.]+) import (?:\(([^)]*)\)|([\w ,]+))")
DOTTED = re.compile(r"django_idempotency((?:\.\w+)+)")


def references(path):
    """Each public name ``path`` uses, as (module, name or None), with its line."""
    text = path.read_text()
    for match in IMPORT.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        for name in (match.group(2) or match.group(3)).replace("\n", " ").split(","):
            if name.strip():
                yield match.group(1), name.strip().split(" as ")[0], line
    for match in DOTTED.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        module, *rest = match.group(1).lstrip(".").split(".")
        yield module, rest[0] if rest else None, line


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_the_docs_name_public_modules_and_names_only(page):
    if page.name == "changelog.md":  # history names what was, public or not
        return
    leaks = []
    for module, name, line in references(page):
        if CHECK_ID.fullmatch(module) or (name is None and module in TASK_NAMES):
            continue
        if module not in PUBLIC or (name is not None and name not in PUBLIC[module]):
            leaks.append(f"{page.name}:{line}: django_idempotency.{module}.{name or ''}")
    assert not leaks, "\n".join(leaks)
