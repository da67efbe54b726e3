"""Conditional requests: strong ETags, ``If-Match`` and ``If-None-Match`` (RFC 9110 §13).

A client that read a resource sends its ``ETag`` back in ``If-Match`` with an update; the update
applies only if the resource has not changed since, so two clients that edit the same resource
cannot overwrite each other's work (the "lost update"). The check and the write are one atomic
step in the database: a compare-and-set of a version column (``UPDATE … WHERE version = …``), or
a row lock (``SELECT … FOR UPDATE``) held from the check to the commit.

This module knows Django but not Django REST framework: ``django_idempotency.drf.ConditionalMixin``
and ``django_idempotency.decorators.conditional`` are the adapters.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from django.db.models import F
from django.utils.cache import get_conditional_response

from django_idempotency import problems
from django_idempotency.core.fingerprint import canonical_json

if TYPE_CHECKING:
    from django.db.models import Model
    from django.http import HttpRequest, HttpResponse

__all__ = ["PreconditionError", "etag_for_content", "etag_for_version"]

# The methods whose precondition guards a write. (POST creates; it has no current representation.)
CONDITIONAL_METHODS = frozenset({"PUT", "PATCH", "DELETE"})

# RFC 9110 §8.8.3: entity-tag = [ "W/" ] DQUOTE *etagc DQUOTE; etagc excludes DQUOTE.
_ENTITY_TAG = re.compile(r'(?:W/)?"[\x21\x23-\x7e\x80-\xff]*"')


class PreconditionError(Exception):
    """A precondition did not hold: ``response`` is the answer to send instead of the view's."""

    def __init__(self, response: HttpResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def etag_for_version(version: object) -> str:
    """Return the strong ETag of a version column's value: ``7`` gives ``"7"``."""
    return f'"{version}"'


def etag_for_content(content: bytes) -> str:
    """Return a strong ETag for a representation's content.

    JSON is put in its canonical form first, so the ETag does not change with key order
    or whitespace, nor between renderers that serialize the same data differently.
    """
    canonical = canonical_json(content)
    digest = hashlib.sha256(content if canonical is None else canonical).hexdigest()
    return f'"{digest[:32]}"'


def parse_if_match(request: HttpRequest) -> list[str] | None:
    """Return the entity tags of ``If-Match`` (``["*"]`` for any), or ``None`` if it is absent.

    Raise ``PreconditionError`` (400 ``precondition.invalid``) for a malformed header: ignoring
    it, as RFC 9110 lets a server do, would let an unquoted ETag update without any check.
    """
    value = request.headers.get("If-Match")
    if value is None:
        return None
    value = value.strip()
    if value == "*":
        return ["*"]
    tags = [tag.strip() for tag in value.split(",")]
    if not value or not all(_ENTITY_TAG.fullmatch(tag) for tag in tags):
        raise PreconditionError(
            problems.problem_response(
                problems.PRECONDITION_INVALID,
                'If-Match must be "*" or a list of quoted entity tags, such as If-Match: "7".',
            )
        )
    return tags


def names_a_version(request: HttpRequest) -> bool:
    """Whether ``If-Match`` names versions: not absent, and not ``*`` (any version will do)."""
    if_match = request.headers.get("If-Match", "").strip()
    return if_match not in {"", "*"}


def check_preconditions(
    request: HttpRequest,
    etag: str | None,
    *,
    required: bool = False,
    response: HttpResponse | None = None,
) -> HttpResponse | None:
    """Evaluate the request's preconditions against the resource's current ``etag``.

    Return the answer to send instead of running the view: ``304`` for a ``GET`` or ``HEAD``
    whose ``If-None-Match`` matches, ``412 precondition.failed`` (with the current ``ETag``) for
    an unsafe method whose ``If-Match`` does not, ``428 precondition.required`` for an unsafe
    method without ``If-Match`` when ``required``, ``400 precondition.invalid`` for a malformed
    ``If-Match``. Return ``None`` when the view may run. ``etag`` is ``None`` when the resource
    does not exist: then the view runs and answers (usually 404). A ``304`` keeps the caching
    headers of ``response``, the answer it replaces, when there is one.
    """
    method = request.method or ""
    try:
        if_match = parse_if_match(request)
    except PreconditionError as error:
        return error.response
    if etag is None:
        return None
    if method in CONDITIONAL_METHODS and if_match is None and required:
        return precondition_required(method)
    # Django evaluates If-Match, If-Unmodified-Since, If-None-Match and If-Modified-Since in the
    # order of RFC 9110 §13.2.2, comparing strongly for If-Match and weakly for If-None-Match.
    answer = get_conditional_response(request, etag=etag, response=response)
    if answer is None or answer is response:
        return None
    if answer.status_code == 412:
        return precondition_failed(etag)
    answer["ETag"] = etag
    return answer


def precondition_failed(etag: str | None) -> HttpResponse:
    """Answer ``412 precondition.failed``, with the resource's current ``ETag`` if it has one."""
    response = problems.problem_response(
        problems.PRECONDITION_FAILED,
        "The resource has changed since the version given in If-Match: read it again, then "
        "retry with its current ETag.",
    )
    if etag is not None:
        response["ETag"] = etag
    return response


def precondition_required(method: str) -> HttpResponse:
    """Answer ``428 precondition.required``."""
    return problems.problem_response(
        problems.PRECONDITION_REQUIRED,
        f"{method} needs an If-Match header with the ETag of the version you read.",
    )


def advance_version(instance: Model, field: str, *, expected: bool) -> None:
    """Add one to ``instance``'s version column, in the database and on ``instance``.

    With ``expected``, only if the row still has the version that ``instance`` was read with: one
    statement, ``UPDATE … SET field = field + 1 WHERE pk = … AND field = <read>``. Of two
    concurrent updates of the same version, the second waits for the first's row lock, then
    finds the version moved and changes nothing: it raises ``PreconditionError`` (412). Call it
    inside the transaction that makes the change, before the change.
    """
    rows = type(instance)._base_manager.filter(pk=instance.pk)
    read = getattr(instance, field)
    if not expected:
        rows.update(**{field: F(field) + 1})
        instance.refresh_from_db(fields=[field])
    elif rows.filter(**{field: read}).update(**{field: F(field) + 1}):
        setattr(instance, field, read + 1)
    else:
        current = rows.values_list(field, flat=True).first()
        raise PreconditionError(
            precondition_failed(None if current is None else etag_for_version(current))
        )
