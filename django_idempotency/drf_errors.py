"""An opt-in DRF exception handler: the REST framework's errors as problems, with advice.

Set ``REST_FRAMEWORK["EXCEPTION_HANDLER"] =
"django_idempotency.drf_errors.problem_exception_handler"``. A module of its own: it imports
``rest_framework.views``, which reads ``DEFAULT_PARSER_CLASSES`` on import, and that setting may
name ``django_idempotency.drf.JSONParser``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404

from django_idempotency.core import optional

__all__ = ["DependencyTimeout", "DependencyUnavailable", "problem_exception_handler"]

with optional.requires("drf", __name__):
    from rest_framework import exceptions
    from rest_framework.views import exception_handler

from django_idempotency import problems
from django_idempotency.core.unavailable import unavailable_answer

if TYPE_CHECKING:
    from django.http import HttpResponse


class DependencyUnavailable(exceptions.APIException):
    """Raise when a service the view needs is down: ``503 dependency.unavailable``.

    ``wait`` (seconds) is sent as ``Retry-After``.
    """

    status_code = 503
    default_detail = "A service this request depends on is unavailable; retry it."
    default_code = "dependency_unavailable"

    def __init__(
        self, detail: str | None = None, code: str | None = None, *, wait: float | None = None
    ) -> None:
        super().__init__(detail, code)
        self.wait = wait  # read by DRF's exception_handler, as Throttled's is


class DependencyTimeout(DependencyUnavailable):
    """Raise when a service the view called did not answer in time: ``504 transient.timeout``.

    Its effect may have happened: the client retries with the same key, so it happens once.
    """

    status_code = 504
    default_detail = "A service this request depends on did not answer in time; retry it."
    default_code = "dependency_timeout"


# First match wins: subclasses before their bases.
_PROBLEM_OF: tuple[tuple[type[Exception], problems.Problem], ...] = (
    (exceptions.ValidationError, problems.VALIDATION_INVALID),
    (exceptions.ParseError, problems.VALIDATION_INVALID),
    (exceptions.UnsupportedMediaType, problems.UNSUPPORTED_MEDIA_TYPE),
    (exceptions.NotAuthenticated, problems.NOT_AUTHENTICATED),
    (exceptions.AuthenticationFailed, problems.AUTHENTICATION_FAILED),
    (exceptions.PermissionDenied, problems.PERMISSION_DENIED),
    (DjangoPermissionDenied, problems.PERMISSION_DENIED),
    (exceptions.NotFound, problems.NOT_FOUND),
    (Http404, problems.NOT_FOUND),
    (exceptions.MethodNotAllowed, problems.API_METHOD_NOT_ALLOWED),
    (exceptions.NotAcceptable, problems.NOT_ACCEPTABLE),
    (exceptions.Throttled, problems.RATE_LIMITED),
    (DependencyTimeout, problems.DEPENDENCY_TIMEOUT),
    (DependencyUnavailable, problems.DEPENDENCY_UNAVAILABLE),
)


def problem_of(exc: Exception, status: int) -> problems.Problem:
    """The problem that answers ``exc``; an exception may set its own as ``problem``."""
    problem = getattr(exc, "problem", None)
    if not isinstance(problem, problems.Problem):
        problem = next(
            (problem for kind, problem in _PROBLEM_OF if isinstance(exc, kind)),
            problems.SERVER_ERROR if status >= 500 else problems.REQUEST_REJECTED,
        )
    # DRF may change the status (a NotAuthenticated without a challenge to offer is a 403).
    return dataclasses.replace(problem, status=status)


def problem_exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse | None:
    """Answer the REST framework's errors as ``application/problem+json``, with a stable code.

    Set as ``REST_FRAMEWORK["EXCEPTION_HANDLER"]``. Another exception is left to Django (500).
    """
    # The answer IdempotentMixin gives, for views without it: the failure is transient.
    if (unavailable := unavailable_answer(exc)) is not None:
        return unavailable
    # DRF's own handler first: it rolls back ATOMIC_REQUESTS, so the idempotency layer keeps
    # exactly what it keeps today, and it computes the WWW-Authenticate and Retry-After headers.
    response = exception_handler(exc, context)
    if response is None:
        return None
    problem = problem_of(exc, response.status_code)
    extra: dict[str, Any] = {}
    if isinstance(exc, exceptions.APIException) and not isinstance(exc.detail, str):
        # A ValidationError (always a list or a dict of fields), or any error raised with one:
        # the body DRF would have sent.
        detail = f"{problem.title}; see errors."
        extra["errors"] = exc.detail
    elif isinstance(exc, exceptions.APIException):
        detail = str(exc.detail)
        if isinstance(exc, exceptions.ParseError):
            extra["errors"] = [exc.detail]  # a body that cannot be parsed is invalid too
    else:  # Http404 or Django's PermissionDenied, converted by DRF's handler
        detail = str(response.data["detail"])
    answer = problems.problem_response(problem, detail, extra=extra)
    for header in ("WWW-Authenticate", "Retry-After"):
        if header in response:
            answer[header] = response[header]
    return answer
