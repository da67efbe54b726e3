"""drf-spectacular: document idempotent and conditional operations in the OpenAPI schema.

Loaded by the app when drf-spectacular is installed; nothing to configure. Every operation of a
view with ``IdempotentMixin`` whose method the view protects gets the ``Idempotency-Key`` header
parameter (required or optional as the view says, with the key's format and lifetime), the
``400``, ``409``, ``411``, ``422`` and ``503`` problem answers (and ``403`` when anonymous
keys are rejected), and the ``Idempotency-Status`` and ``Idempotent-Replayed`` headers on its
success answers. A view with ``ConditionalMixin`` gets ``If-Match`` on ``PUT``, ``PATCH`` and
``DELETE``, ``If-None-Match`` on ``GET``, the ``ETag`` header, and the ``304``, ``412`` and
``428`` answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_idempotency.core import deprecation, optional

# Named first: the openapi extra brings Django REST framework too.
with optional.requires("openapi", __name__):
    from drf_spectacular.drainage import warn
    from drf_spectacular.extensions import OpenApiViewExtension
    from drf_spectacular.plumbing import ResolvedComponent, get_class

from django_idempotency.conditional import CONDITIONAL_METHODS
from django_idempotency.core.openapi_contract import (
    PROBLEM_NAME,
    PROBLEM_SCHEMA,
    SUCCESS_HEADERS,
    Answer,
    answers,
    header_parameter,
    key_parameter,
    problem_response,
)
from django_idempotency.drf import ConditionalMixin, IdempotentMixin

if TYPE_CHECKING:
    from collections.abc import Iterable

    from drf_spectacular.openapi import AutoSchema
    from rest_framework.views import APIView

__all__ = ["IdempotencySchemaExtension", "document"]

if TYPE_CHECKING:
    from django_idempotency.problems import PROBLEM_MEDIA_TYPE  # noqa: F401 - deprecated here
else:
    # Its one home is django_idempotency.problems, which both frameworks' modules share.
    __getattr__ = deprecation.moved(__name__, {"PROBLEM_MEDIA_TYPE": "django_idempotency.problems"})

# A component, as drf-spectacular shares a schema. Its code has no enum: drf-spectacular would
# turn it into a "CodeEnum" component, a name that the project's own serializers may use.
_PROBLEM = ResolvedComponent(  # type: ignore[no-untyped-call]
    name=PROBLEM_NAME,
    type=ResolvedComponent.SCHEMA,
    object="django_idempotency.problems.Problem",
    schema=PROBLEM_SCHEMA,
)

_CONDITIONAL_ANSWERS = (
    Answer(400, "The If-Match header is malformed (`precondition.invalid`)."),
    Answer(
        412,
        "The resource changed since the given ETag (`precondition.failed`); "
        "the ETag header has the current one.",
    ),
    Answer(428, "This request needs an If-Match header (`precondition.required`)."),
)


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
            _add_parameter(operation, key_parameter(policy))
            _add_problems(operation, answers())
            _add_success_headers(operation, SUCCESS_HEADERS)
    if isinstance(view, ConditionalMixin):
        _document_conditional(operation, view, method)


def _document_conditional(operation: dict[str, Any], view: ConditionalMixin, method: str) -> None:
    etag = {
        "ETag": {"description": "The resource's current strong ETag.", "schema": {"type": "string"}}
    }
    if method in CONDITIONAL_METHODS:
        if_match = header_parameter(
            "If-Match",
            required=view.precondition_required,
            description="The ETag of the version you read: the change applies only to that one.",
            schema={"type": "string"},
        )
        _add_parameter(operation, if_match)
        _add_problems(
            operation,
            (
                answer
                for answer in _CONDITIONAL_ANSWERS
                if answer.status != 428 or view.precondition_required
            ),
        )
        operation["responses"]["412"]["headers"] = etag
        if method != "DELETE":
            _add_success_headers(operation, etag)
    elif method == "GET":
        if_none_match = header_parameter(
            "If-None-Match",
            required=False,
            description="The ETag you hold: an unchanged resource answers 304, without a body.",
            schema={"type": "string"},
        )
        _add_parameter(operation, if_none_match)
        operation["responses"].setdefault(
            "304", {"description": "Not modified: the ETag still matches.", "headers": etag}
        )
        _add_success_headers(operation, etag)


def _add_parameter(operation: dict[str, Any], parameter: dict[str, Any]) -> None:
    parameters = operation.setdefault("parameters", [])
    name = parameter["name"].lower()
    if any(p.get("in") == "header" and p.get("name", "").lower() == name for p in parameters):
        return  # documented by the view already
    parameters.append(parameter)


def _add_problems(operation: dict[str, Any], answers: Iterable[Answer]) -> None:
    responses = operation.setdefault("responses", {})
    for answer in answers:
        ours = problem_response(answer, _PROBLEM.ref)
        # A status the view documents already (a 400 for invalid data) keeps its description
        # and gains the problem media type, and our headers.
        response = responses.setdefault(str(answer.status), {"description": ours["description"]})
        response.setdefault("content", {}).update(ours["content"])
        if "headers" in ours:
            response.setdefault("headers", {}).update(ours["headers"])


def _add_success_headers(operation: dict[str, Any], headers: dict[str, Any]) -> None:
    for status, response in operation.get("responses", {}).items():
        if str(status).startswith("2"):
            response.setdefault("headers", {}).update(headers)
