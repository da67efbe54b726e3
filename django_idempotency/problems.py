"""Errors answered as ``application/problem+json`` (RFC 9457), each with a stable ``code``."""

from __future__ import annotations

import json
from dataclasses import dataclass

from django.http import HttpResponse

# RFC 9457 section 3.1.1: a "tag:" URI names a problem type that is not meant to be dereferenced.
TYPE_PREFIX = "tag:django-idempotency,2026:"


@dataclass(frozen=True)
class Problem:
    code: str
    status: int
    title: str
    retry_after: int | None = None


KEY_MISSING = Problem("idempotency.key_missing", 400, "An idempotency key is required")
KEY_INVALID = Problem("idempotency.key_invalid", 400, "The idempotency key is malformed")
ANONYMOUS_REJECTED = Problem(
    # 403, as DRF answers an unauthenticated request when it has no WWW-Authenticate to offer.
    "idempotency.anonymous_rejected",
    403,
    "Authentication is required to use an idempotency key",
)
BODY_INVALID = Problem(
    "idempotency.body_invalid", 400, "The request body cannot be read to fingerprint it"
)
LENGTH_REQUIRED = Problem(
    "idempotency.length_required", 411, "The request body must be sent with a Content-Length"
)
PAYLOAD_MISMATCH = Problem(
    "idempotency.payload_mismatch", 422, "The idempotency key was used with a different request"
)
IN_PROGRESS = Problem(
    "idempotency.in_progress", 409, "A request with this idempotency key is in progress", 1
)
UNAVAILABLE = Problem(
    "idempotency.unavailable", 503, "The request could not be completed; retry it", 1
)


# Conditional requests (If-Match).
PRECONDITION_FAILED = Problem(
    "precondition.failed", 412, "The resource has changed since the given version"
)
PRECONDITION_REQUIRED = Problem(
    "precondition.required", 428, "This request must be conditional (If-Match)"
)
PRECONDITION_INVALID = Problem("precondition.invalid", 400, "The If-Match header is malformed")

# The webhook inbox's answers to a sender.
SIGNATURE_MISSING = Problem("inbox.signature_missing", 400, "The webhook signature is missing")
SIGNATURE_INVALID = Problem("inbox.signature_invalid", 400, "The webhook signature is not valid")
SIGNATURE_EXPIRED = Problem(
    "inbox.signature_expired", 400, "The webhook signature is outside the tolerance window"
)
PAYLOAD_TOO_LARGE = Problem("inbox.payload_too_large", 413, "The webhook payload is too large")
PAYLOAD_INVALID = Problem("inbox.payload_invalid", 400, "The webhook payload cannot be read")
PAYLOAD_LENGTH_REQUIRED = Problem(
    "inbox.length_required", 411, "The webhook must be sent with a Content-Length"
)
EVENT_CONFLICT = Problem(
    "inbox.event_conflict", 409, "An event with this id was received with a different payload"
)
METHOD_NOT_ALLOWED = Problem("inbox.method_not_allowed", 405, "Webhooks are delivered by POST")

# Codes are stable: never reuse one. Retired: inbox.processing_failed (a recorded event whose
# processing fails answers 202 since the retries are the inbox's).
ALL = (
    KEY_MISSING,
    KEY_INVALID,
    ANONYMOUS_REJECTED,
    BODY_INVALID,
    LENGTH_REQUIRED,
    PAYLOAD_MISMATCH,
    IN_PROGRESS,
    UNAVAILABLE,
    PRECONDITION_FAILED,
    PRECONDITION_REQUIRED,
    PRECONDITION_INVALID,
    SIGNATURE_MISSING,
    SIGNATURE_INVALID,
    SIGNATURE_EXPIRED,
    PAYLOAD_TOO_LARGE,
    PAYLOAD_INVALID,
    PAYLOAD_LENGTH_REQUIRED,
    EVENT_CONFLICT,
    METHOD_NOT_ALLOWED,
)
BY_CODE = {problem.code: problem for problem in ALL}


def problem_response(problem: Problem, detail: str) -> HttpResponse:
    """Render ``problem`` as an RFC 9457 response; ``detail`` must never carry request data."""
    body = {
        "type": TYPE_PREFIX + problem.code,
        "title": problem.title,
        "status": problem.status,
        "detail": detail,
        "code": problem.code,
    }
    response = HttpResponse(
        json.dumps(body), status=problem.status, content_type="application/problem+json"
    )
    if problem.retry_after is not None:
        response["Retry-After"] = str(problem.retry_after)
    return response
