"""The idempotency contract as OpenAPI describes it: the key's header, the answers, their headers.

Written once, for every schema that documents an idempotent operation: the drf-spectacular
extension (``openapi``) and the Django Ninja adapter (``ninja``) render these plain OpenAPI
objects, so that their schemas cannot drift apart. Imports no framework: each is optional.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django_idempotency import problems
from django_idempotency.conf import idempotency_settings
from django_idempotency.core.responses import REPLAYED_HEADER, STATUS_HEADER
from django_idempotency.keys import MAX_LENGTH
from django_idempotency.problems import PROBLEM_MEDIA_TYPE

if TYPE_CHECKING:
    from datetime import timedelta

    from django_idempotency.policy import Policy

PROBLEM_NAME = "IdempotencyProblem"
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An error of RFC 9457, with a stable code.",
    "properties": {
        "type": {"type": "string", "format": "uri"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "code": {
            "type": "string",
            "description": "The stable error code: " + ", ".join(sorted(problems.BY_CODE)),
        },
    },
    "required": ["type", "title", "status", "detail", "code"],
}

# A bare key, as keys.parse_key accepts it: visible ASCII (RFC 5234 VCHAR). The draft's quoted
# form ("abc") names the same key with two more characters.
KEY_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH, "pattern": "^[!-~]+$"}

RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying with the same key.",
        "schema": {"type": "integer", "minimum": 0},
    }
}

SUCCESS_HEADERS = {
    STATUS_HEADER: {
        "description": "`stored` for a first answer, `replayed` for a replay.",
        "schema": {"type": "string", "enum": ["stored", "replayed"]},
    },
    REPLAYED_HEADER: {
        "description": "`true` when the answer is a replay.",
        "schema": {"type": "string", "enum": ["true"]},
    },
}


@dataclass(frozen=True)
class Answer:
    """A problem answer: its status, what it means, and whether it sends ``Retry-After``."""

    status: int
    description: str
    retry_after: bool = False


IDEMPOTENCY_ANSWERS = (
    Answer(
        400,
        "The idempotency key is missing or malformed "
        "(`idempotency.key_missing`, `idempotency.key_invalid`), or the body cannot be read "
        "to fingerprint the request (`idempotency.body_invalid`).",
    ),
    Answer(
        411,
        "A request with a key and a body must give the body's length in `Content-Length` "
        "(`idempotency.length_required`).",
    ),
    Answer(
        409,
        "A request with this key is still in progress (`idempotency.in_progress`); "
        "retry with the same key after `Retry-After` seconds.",
        retry_after=True,
    ),
    Answer(
        422,
        "The key was used with a different request (`idempotency.payload_mismatch`); "
        "a new operation needs a new key.",
    ),
    Answer(
        503,
        "The database could not complete the request (`idempotency.unavailable`); "
        "retry with the same key after `Retry-After` seconds.",
        retry_after=True,
    ),
)
ANONYMOUS_ANSWER = Answer(
    403,
    "The request has a key but no authenticated user (`idempotency.anonymous_rejected`); "
    "authenticate, then retry with the same key.",
)


def answers() -> tuple[Answer, ...]:
    """The problem answers of an idempotent operation, under the ``ANONYMOUS`` setting now."""
    if idempotency_settings.ANONYMOUS == "reject":
        return (*IDEMPOTENCY_ANSWERS, ANONYMOUS_ANSWER)
    return IDEMPOTENCY_ANSWERS


def problem_response(answer: Answer, schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI response object of ``answer``, its body described by ``schema``."""
    response: dict[str, Any] = {
        "description": answer.description,
        "content": {PROBLEM_MEDIA_TYPE: {"schema": schema}},
    }
    if answer.retry_after:
        response["headers"] = RETRY_AFTER
    return response


def header_parameter(
    name: str, *, required: bool, description: str, schema: dict[str, Any]
) -> dict[str, Any]:
    """An OpenAPI parameter object for the request header ``name``."""
    return {
        "in": "header",
        "name": name,
        "required": required,
        "description": description,
        "schema": schema,
    }


def key_parameter(policy: Policy) -> dict[str, Any]:
    """The key's header parameter under ``policy``: whether it is required, its format, its TTL."""
    description = (
        "A unique value for each logical operation, sent again with each retry: a retry gets "
        "the first answer back, and the operation runs once. "
        f"1 to {MAX_LENGTH} visible ASCII characters, such as a UUID; a bare key has no comma. "
        f"The key is kept for {_duration(policy.ttl)} after its first request; after that, the "
        "same key runs the operation again."
    )
    return {
        **header_parameter(
            policy.header, required=policy.required, description=description, schema=KEY_SCHEMA
        ),
        # The IETF draft asks a resource to publish its key's expiry policy; the description
        # says it to people, this says it to programs.
        "x-idempotency-key-ttl-seconds": int(policy.ttl.total_seconds()),
    }


def _duration(ttl: timedelta) -> str:
    """``ttl`` in the largest unit that says it exactly: "24 hours", "90 minutes"."""
    seconds = int(ttl.total_seconds())
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        # Under two days in hours, as the settings speak of "24 hours".
        if seconds % size == 0 and seconds >= size * (2 if unit == "day" else 1):
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"
