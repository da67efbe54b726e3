"""One answer to a database that is unavailable: the retryable 503 ``idempotency.unavailable``.

Each adapter applies ``answers_unavailable`` around its view: the view decorator, Ninja's
operations and the inbox's receiver. Django REST framework hands every error of a view to
``handle_exception`` (and to the project's exception handler) instead, so the mixin and
``drf_errors`` ask ``unavailable_answer`` there. Within the key's handling, where the answer is
also the key's decision, reported with it, ``core/keyed_request.py`` builds the same answer with
``unavailable_response``, saying whether the key's transaction kept nothing.
"""

from __future__ import annotations

import logging
from functools import wraps
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import iscoroutinefunction
from django.db import InterfaceError, OperationalError, connections

from django_idempotency import problems

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.http import HttpResponse

F = TypeVar("F", bound="Callable[..., Any]")

logger = logging.getLogger("django_idempotency")

# Connection lost, server shutting down, deadlock, serialization failure: errors of the
# database's operation rather than of the code, worth a retry.
DATABASE_UNAVAILABLE = (OperationalError, InterfaceError)


def unavailable_response(*, rolled_back: bool) -> HttpResponse:
    """Log the current database error and answer 503 ``idempotency.unavailable``.

    ``rolled_back`` says whether the engine's transaction held everything the view did, so
    that the client can be told nothing was kept.
    """
    logger.warning("database unavailable", exc_info=True)
    # Under ATOMIC_REQUESTS the request's own transaction is still open on a dead connection:
    # mark it for rollback, or Django would try to commit it and answer 500 after all.
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            connection.set_rollback(True)
    detail = "The database could not complete the request"
    detail += "; nothing was kept. Retry it." if rolled_back else ". Retry it."
    return problems.problem_response(problems.UNAVAILABLE, detail)


def unavailable_answer(error: BaseException) -> HttpResponse | None:
    """The 503 that answers ``error``, raised while handling it, if the database is
    unavailable; ``None`` for any other error."""
    if isinstance(error, DATABASE_UNAVAILABLE):
        return unavailable_response(rolled_back=False)
    return None


def answers_unavailable(view: F) -> F:
    """Answer the retryable 503 when the database fails around ``view`` (sync or async), before
    the key is looked at (authentication queries it, after a failover say) or without one.
    Never a bare 500."""
    if iscoroutinefunction(view):

        @wraps(view)
        async def async_view(*args: Any, **kwargs: Any) -> Any:
            try:
                return await view(*args, **kwargs)
            except DATABASE_UNAVAILABLE:
                return unavailable_response(rolled_back=False)

        return async_view  # type: ignore[return-value] # the same signature

    @wraps(view)
    def sync_view(*args: Any, **kwargs: Any) -> Any:
        try:
            return view(*args, **kwargs)
        except DATABASE_UNAVAILABLE:
            return unavailable_response(rolled_back=False)

    return sync_view  # type: ignore[return-value] # the same signature
