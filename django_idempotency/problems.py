"""Errors answered as ``application/problem+json`` (RFC 9457), each with a stable ``code``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from django.http import HttpResponse

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["PROBLEM_MEDIA_TYPE", "Problem"]

#: The media type of every problem answered (RFC 9457 section 3), for a schema or a client.
PROBLEM_MEDIA_TYPE = "application/problem+json"

# What a client does with its idempotency key when it sends the request again: the same key
# (nothing was kept under it), a new key (the key is bound to another request, or its answer
# was kept), or not at all (the answer is final).
Retry = Literal["same_key", "new_key", "no"]

# RFC 9457 section 3.1.1: a "tag:" URI names a problem type that is not meant to be dereferenced.
TYPE_PREFIX = "tag:django-idempotency,2026:"


@dataclass(frozen=True)
class Problem:
    code: str
    status: int
    title: str
    retry_after: int | None = None
    # Sent as the "retryable" and "retry" members when set: whether the same request may
    # succeed if sent again, and with which key.
    retryable: bool | None = None
    retry: Retry | None = None


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

# The REST framework's own errors, answered by the opt-in exception handler
# (django_idempotency.drf_errors.problem_exception_handler). The advice holds for the default
# INVALID_REQUEST_STATUS_CODES and RETRYABLE_STATUS_CODES: a 400, 406 or 415 is not kept under
# the key, so the corrected request may reuse it; a 404 or 405 from the view is kept and replayed.
VALIDATION_INVALID = Problem(
    "validation.invalid", 400, "The request is invalid", retryable=False, retry="same_key"
)
UNSUPPORTED_MEDIA_TYPE = Problem(
    "validation.unsupported_media_type",
    415,
    "The request body's media type is not supported",
    retryable=False,
    retry="same_key",
)
NOT_AUTHENTICATED = Problem(
    "auth.not_authenticated", 401, "Authentication is required", retryable=False, retry="same_key"
)
AUTHENTICATION_FAILED = Problem(
    "auth.authentication_failed",
    401,
    "The credentials are not valid",
    retryable=False,
    retry="same_key",
)
PERMISSION_DENIED = Problem(
    "auth.permission_denied", 403, "Permission denied", retryable=False, retry="no"
)
NOT_FOUND = Problem("not_found", 404, "Not found", retryable=False, retry="no")
API_METHOD_NOT_ALLOWED = Problem(
    "method_not_allowed", 405, "The method is not allowed", retryable=False, retry="no"
)
NOT_ACCEPTABLE = Problem(
    "not_acceptable",
    406,
    "No representation matches the Accept header",
    retryable=False,
    retry="same_key",
)
RATE_LIMITED = Problem(
    "rate_limit.exceeded", 429, "Too many requests", retryable=True, retry="same_key"
)
DEPENDENCY_UNAVAILABLE = Problem(
    "dependency.unavailable",
    503,
    "A service this request depends on is unavailable",
    retryable=True,
    retry="same_key",
)
# The effect downstream may have happened: only a retry with the same key is safe.
DEPENDENCY_TIMEOUT = Problem(
    "transient.timeout",
    504,
    "A service this request depends on did not answer in time",
    retryable=True,
    retry="same_key",
)
# Any other error of the REST framework, by its status: a 5xx is never kept under the key.
SERVER_ERROR = Problem(
    "server.error", 500, "The request could not be completed", retryable=True, retry="same_key"
)
REQUEST_REJECTED = Problem(
    "request.rejected", 400, "The request was rejected", retryable=False, retry="no"
)
API_ERRORS = (
    VALIDATION_INVALID,
    UNSUPPORTED_MEDIA_TYPE,
    NOT_AUTHENTICATED,
    AUTHENTICATION_FAILED,
    PERMISSION_DENIED,
    NOT_FOUND,
    API_METHOD_NOT_ALLOWED,
    NOT_ACCEPTABLE,
    RATE_LIMITED,
    DEPENDENCY_UNAVAILABLE,
    DEPENDENCY_TIMEOUT,
    SERVER_ERROR,
    REQUEST_REJECTED,
)


def problem_response(
    problem: Problem, detail: str, *, extra: Mapping[str, Any] | None = None
) -> HttpResponse:
    """Render ``problem`` as an RFC 9457 response; ``detail`` must never carry request data.

    ``extra`` holds extension members (RFC 9457 section 3.2), such as a form's field errors.
    """
    body: dict[str, Any] = {
        "type": TYPE_PREFIX + problem.code,
        "title": problem.title,
        "status": problem.status,
        "detail": detail,
        "code": problem.code,
    }
    if problem.retry is not None:
        body["retryable"] = problem.retryable
        body["retry"] = problem.retry
    body.update(extra or {})
    response = HttpResponse(
        json.dumps(body), status=problem.status, content_type=PROBLEM_MEDIA_TYPE
    )
    if problem.retry_after is not None:
        response["Retry-After"] = str(problem.retry_after)
    return response
