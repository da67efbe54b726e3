"""Signals sent for each idempotency decision, and for each step of an inbox event.

The decision signals are sent with ``sender`` set to the view's class (or function) and these
keyword arguments: ``request`` (the request the view sees), ``key`` (``None`` when missing or
invalid), ``scope`` and ``route`` (``None`` when not yet resolved), ``response`` (the response
returned, or ``None`` when the view raised), ``outcome`` (the outcome's name, as in the logs),
``attempt`` (the lease-mode attempt, or the replay's number) and ``overhead`` (the seconds the
engine added to the request, the view's own time left out).
Receivers run in the request (or the worker), so keep them fast; they are called with
``send_robust()``, and an exception in one is logged, never turned into an error for the client.
"""

from __future__ import annotations

import logging

from django.dispatch import Signal

__all__ = [
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
]

logger = logging.getLogger("django_idempotency")

#: A fresh request ran and its response was stored with the key.
key_stored = Signal()
#: A completed request was replayed; the view did not run.
key_replayed = Signal()
#: The key was reused with a different request: answered 422.
payload_mismatch = Signal()
#: A request with the key was still running past the wait bound: answered 409.
request_in_progress = Signal()
#: A required key was missing: answered 400.
key_missing = Signal()
#: The key was malformed, or the anonymous policy refused it: answered 400 or 403.
key_invalid = Signal()
#: The view ran but its response was not stored (it raised, answered 5xx or a retryable status,
#: or marked its transaction for rollback): what it wrote was rolled back; a retry runs again.
response_not_stored = Signal()
#: The database failed mid-request: rolled back and answered 503.
database_unavailable = Signal()

#: Every decision signal above, for a receiver of all outcomes (it reads ``outcome``).
DECISION_SIGNALS = (
    key_stored,
    key_replayed,
    payload_mismatch,
    request_in_progress,
    key_missing,
    key_invalid,
    response_not_stored,
    database_unavailable,
)


# The webhook inbox's signals are sent with ``sender`` set to ``InboxEvent`` and ``event``, the
# ``InboxEvent`` concerned. They are sent after the transaction that changed the event commits.

#: A new event was recorded.
inbox_event_received = Signal()
#: A delivery repeated an event already recorded; ``conflict`` is True when its payload differs
#: (answered 409) and False when it is the same (answered 200). Nothing was processed.
inbox_event_duplicate = Signal()
#: The event's handler ran and its effects committed with the status ``processed``.
inbox_event_processed = Signal()
#: An attempt failed (``error``: the exception); the event is retried at ``event.next_attempt_at``.
inbox_event_failed = Signal()
#: The event failed ``INBOX_MAX_ATTEMPTS`` times and is retried no more; ``error`` is the last
#: exception, or ``None`` when the worker died during the last attempt. A broker message that
#: cannot be processed at all (it has no id) is dead at once, ``error`` a ``PermanentError``.
inbox_event_dead = Signal()
#: A delivery was refused before anything was recorded: sent with ``sender`` set to the receiver
#: view's class, ``source`` and ``reason`` (the problem's code, e.g. ``inbox.signature_invalid``).
inbox_delivery_refused = Signal()


# The idempotent tasks' signal is sent with ``sender`` set to the task (Celery's, or the Tasks
# framework's), and ``task`` (its
# name), ``key``, ``scope``, ``outcome`` (``stored``, ``replayed``, ``mismatch``, ``in_progress``
# or ``not_stored``), ``attempt`` and ``error`` (what the body raised, or ``None``).

#: An idempotent task's run (a Celery delivery, or a run of the Tasks framework) was decided.
task_decided = Signal()


# The lease-mode signals are sent with ``sender`` set to ``IdempotencyKey`` and ``key``.

#: A running lease-mode request (or task) had its lease extended: sent from the process's lease
#: thread, not from the request, every third of the lease.
lease_renewed = Signal()
#: A retry took over a key whose lease ran out: the request that held it died, or lost the
#: database for longer than its lease. Sent with ``scope`` and ``route`` too (the URL pattern, or
#: the task's name), once the takeover commits.
lease_taken_over = Signal()

#: A call to the replay cache failed, and the database answered instead: sent with ``sender`` set
#: to the cache's alias, ``operation`` (``get`` or ``set``) and ``error`` (the exception).
replay_cache_failed = Signal()


def send_robustly(signal: Signal, sender: object, **kwargs: object) -> None:
    """Send ``signal`` to every receiver; log, and otherwise ignore, a receiver that raises."""
    for receiver, result in signal.send_robust(sender=sender, **kwargs):
        if isinstance(result, Exception):
            logger.error("idempotency signal receiver %r raised", receiver, exc_info=result)
