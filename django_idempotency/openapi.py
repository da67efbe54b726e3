"""drf-spectacular: document idempotent and conditional operations in the OpenAPI schema.

Loaded by the app when drf-spectacular is installed; nothing to configure. Every operation of a
view with ``IdempotentMixin`` whose method the view protects gets the ``Idempotency-Key`` header
parameter (required or optional as the view says, with the key's format and lifetime), the
``400``, ``409``, ``422`` and ``503`` problem answers (and ``403`` when anonymous keys are
rejected), and the ``Idempotency-Status`` and ``Idempotent-Replayed`` headers on its success
answers. A view with ``ConditionalMixin`` gets ``If-Match`` on ``PUT``, ``PATCH`` and
``DELETE``, ``If-None-Match`` on ``GET``, the ``ETag`` header, and the ``304``, ``412`` and
``428`` answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_idempotency import _optional

# Named first: the openapi extra brings Django REST framework too.
with _optional.requires("openapi", __name__):
    from drf_spectacular.drainage import warn
    from drf_spectacular.extensions import OpenApiViewExtension
    from drf_spectacular.plumbing import ResolvedComponent, get_class

from django_idempotency import problems
from django_idempotency.conditional import CONDITIONAL_METHODS
from django_idempotency.conf import idempotency_settings
from django_idempotency.drf import ConditionalMixin, IdempotentMixin
from django_idempotency.keys import MAX_LENGTH
from django_idempotency.responses import REPLAYED_HEADER, STATUS_HEADER

if TYPE_CHECKING:
    from datetime import timedelta

    from drf_spectacular.openapi import AutoSchema
    from rest_framework.views import APIView

PROBLEM_MEDIA_TYPE = "application/problem+json"

_PROBLEM = ResolvedComponent(  # type: ignore[no-untyped-call]
    name="IdempotencyProblem",
    type=ResolvedComponent.SCHEMA,
    object="django_idempotency.problems.Problem",
    schema={
        "type": "object",
        "description": "An error of RFC 9457, with a stable code.",
        "properties": {
            "type": {"type": "string", "format": "uri"},
            "title": {"type": "string"},
            "status": {"type": "integer"},
            "detail": {"type": "string"},
            # No enum: drf-spectacular would turn it into a "CodeEnum" component, a name that
            # the project's own serializers may use.
            "code": {
                "type": "string",
                "description": "The stable error code: " + ", ".join(sorted(problems.BY_CODE)),
            },
        },
        "required": ["type", "title", "status", "detail", "code"],
    },
)

_IDEMPOTENCY_ANSWERS = {
    "400": (
        "The idempotency key is missing or malformed "
        "(`idempotency.key_missing`, `idempotency.key_invalid`), or the body cannot be read "
        "to fingerprint the request (`idempotency.body_invalid`)."
    ),
    "411": (
        "A request with a key and a body must give the body's length in `Content-Length` "
        "(`idempotency.length_required`)."
    ),
    "409": (
        "A request with this key is still in progress (`idempotency.in_progress`); "
        "retry with the same key after `Retry-After` seconds."
    ),
    "422": (
        "The key was used with a different request (`idempotency.payload_mismatch`); "
        "a new operation needs a new key."
    ),
    "503": (
        "The database could not complete the request (`idempotency.unavailable`); "
        "retry with the same key after `Retry-After` seconds."
    ),
}
_ANONYMOUS_ANSWER = {
    "403": (
        "The request has a key but no authenticated user (`idempotency.anonymous_rejected`); "
        "authenticate, then retry with the same key."
    ),
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying with the same key.",
        "schema": {"type": "integer", "minimum": 0},
    }
}
# A bare key, as keys.parse_key accepts it: visible ASCII (RFC 5234 VCHAR). The draft's quoted
# form ("abc") names the same key with two more characters.
_KEY_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH, "pattern": "^[!-~]+$"}
_CONDITIONAL_ANSWERS = {
    "400": "The If-Match header is malformed (`precondition.invalid`).",
    "412": (
        "The resource changed since the given ETag (`precondition.failed`); "
        "the ETag header has the current one."
    ),
    "428": "This request needs an If-Match header (`precondition.required`).",
}


class IdempotencySchemaExtension(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Document the views with ``IdempotentMixin`` or ``ConditionalMixin``.

    drf-spectacular applies one view extension per view: a view that another extension
    matches (one of yours, with a higher priority) is documented by that one alone.
    """

    target_class = "rest_framework.views.APIView"
    match_subclasses = True
    priority = -1  # yours first

    def view_replacement(self) -> type[APIView]:
        view: type[APIView] = self.target
        if not issubclass(view, (IdempotentMixin, ConditionalMixin)):
            return view
        base: type[AutoSchema] = get_class(view.schema)

        class IdempotencyAutoSchema(base):  # type: ignore[valid-type,misc] # a class from the view
            def get_operation(self, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
                operation: dict[str, Any] | None = super().get_operation(*args, **kwargs)
                if operation is not None:
                    document(operation, self.view, self.method, self.registry)
                return operation

        # Named and placed as the view, so that drf-spectacular's messages point at it.
        namespace = {
            "schema": IdempotencyAutoSchema(),
            "__module__": view.__module__,
            "__qualname__": view.__qualname__,
            "__doc__": view.__doc__,
        }
        return type(view.__name__, (view,), namespace)


def document(operation: dict[str, Any], view: APIView, method: str, registry: Any) -> None:
    """Add what ``view``'s mixins do for ``method`` to its OpenAPI ``operation``."""
    registry.register_on_missing(_PROBLEM)
    if isinstance(view, IdempotentMixin):
        try:
            policy = view.get_idempotency_policy()
        except Exception as exc:  # reported, as drf-spectacular reports its own problems
            warn(f"cannot document the idempotency of {type(view).__name__}: {exc}")
            policy = None
        if policy is not None and method in policy.methods:
            _add_parameter(
                operation,
                idempotency_settings.HEADER,
                required=policy.required,
                description=(
                    "A unique value for each logical operation, sent again with each retry: a "
                    "retry gets the first answer back, and the operation runs once. "
                    f"1 to {MAX_LENGTH} visible ASCII characters, such as a UUID; a bare key "
                    "has no comma. The key is kept for "
                    f"{_duration(policy.ttl)} after its first request; after that, the same key "
                    "runs the operation again."
                ),
                schema=_KEY_SCHEMA,
                # The IETF draft asks a resource to publish its key's expiry policy; the
                # description says it to people, this says it to programs.
                extensions={"x-idempotency-key-ttl-seconds": int(policy.ttl.total_seconds())},
            )
            answers = dict(_IDEMPOTENCY_ANSWERS)
            if idempotency_settings.ANONYMOUS == "reject":
                answers.update(_ANONYMOUS_ANSWER)
            _add_problems(operation, answers)
            for status in ("409", "503"):
                operation["responses"][status].setdefault("headers", {}).update(_RETRY_AFTER)
            _add_success_headers(
                operation,
                {
                    STATUS_HEADER: {
                        "description": "`stored` for a first answer, `replayed` for a replay.",
                        "schema": {"type": "string", "enum": ["stored", "replayed"]},
                    },
                    REPLAYED_HEADER: {
                        "description": "`true` when the answer is a replay.",
                        "schema": {"type": "string", "enum": ["true"]},
                    },
                },
            )
    if isinstance(view, ConditionalMixin):
        _document_conditional(operation, view, method)


def _document_conditional(operation: dict[str, Any], view: ConditionalMixin, method: str) -> None:
    etag = {
        "ETag": {"description": "The resource's current strong ETag.", "schema": {"type": "string"}}
    }
    if method in CONDITIONAL_METHODS:
        _add_parameter(
            operation,
            "If-Match",
            required=view.precondition_required,
            description="The ETag of the version you read: the change applies only to that one.",
            schema={"type": "string"},
        )
        answers = dict(_CONDITIONAL_ANSWERS)
        if not view.precondition_required:
            del answers["428"]
        _add_problems(operation, answers)
        operation["responses"]["412"]["headers"] = etag
        if method != "DELETE":
            _add_success_headers(operation, etag)
    elif method == "GET":
        _add_parameter(
            operation,
            "If-None-Match",
            required=False,
            description="The ETag you hold: an unchanged resource answers 304, without a body.",
            schema={"type": "string"},
        )
        operation["responses"].setdefault(
            "304", {"description": "Not modified: the ETag still matches.", "headers": etag}
        )
        _add_success_headers(operation, etag)


def _duration(ttl: timedelta) -> str:
    """``ttl`` in the largest unit that says it exactly: "24 hours", "90 minutes"."""
    seconds = int(ttl.total_seconds())
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        # Under two days in hours, as the settings speak of "24 hours".
        if seconds % size == 0 and seconds >= size * (2 if unit == "day" else 1):
            count = seconds // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def _add_parameter(
    operation: dict[str, Any],
    name: str,
    *,
    required: bool,
    description: str,
    schema: Any,
    extensions: dict[str, Any] | None = None,
) -> None:
    parameters = operation.setdefault("parameters", [])
    if any(
        p.get("in") == "header" and p.get("name", "").lower() == name.lower() for p in parameters
    ):
        return  # documented by the view already
    parameters.append(
        {
            "in": "header",
            "name": name,
            "required": required,
            "description": description,
            "schema": schema,
            **(extensions or {}),
        }
    )


def _add_problems(operation: dict[str, Any], answers: dict[str, str]) -> None:
    responses = operation.setdefault("responses", {})
    for status, description in answers.items():
        response = responses.setdefault(status, {"description": description})
        # A status the view documents already (a 400 for invalid data) keeps its description
        # and gains the problem media type.
        response.setdefault("content", {})[PROBLEM_MEDIA_TYPE] = {"schema": _PROBLEM.ref}


def _add_success_headers(operation: dict[str, Any], headers: dict[str, Any]) -> None:
    for status, response in operation.get("responses", {}).items():
        if str(status).startswith("2"):
            response.setdefault("headers", {}).update(headers)
