"""``@idempotent`` and ``@conditional`` for plain Django views."""

from __future__ import annotations

from functools import partial, wraps
from inspect import iscoroutinefunction
from typing import TYPE_CHECKING, Any, overload

from django.core.exceptions import ImproperlyConfigured
from django.db import router, transaction

from django_idempotency.conditional import (
    CONDITIONAL_METHODS,
    PreconditionError,
    advance_version,
    check_preconditions,
    etag_for_version,
    names_a_version,
)
from django_idempotency.core import hooks
from django_idempotency.core.engine import Engine, default_engine
from django_idempotency.core.keyed_request import around_async, handle
from django_idempotency.core.optional import installed
from django_idempotency.core.unavailable import answers_unavailable
from django_idempotency.policy import Policy, check_option_names

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Unpack

    from django.db.models import Model, QuerySet
    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency.policy import Recover, ViewOptions

    ViewFunction = Callable[..., HttpResponseBase]

__all__ = ["conditional", "idempotent"]


@overload
def idempotent(view: ViewFunction, /) -> ViewFunction: ...
@overload
def idempotent(
    *,
    recover: Recover | None = None,
    engine: Engine | None = None,
    **options: Unpack[ViewOptions],
) -> Callable[[ViewFunction], ViewFunction]: ...
def idempotent(
    view: ViewFunction | None = None,
    /,
    *,
    recover: Recover | None = None,
    engine: Engine | None = None,
    **options: Unpack[ViewOptions],
) -> ViewFunction | Callable[[ViewFunction], ViewFunction]:
    """Make a view's unsafe methods idempotent by ``Idempotency-Key``.

    Use bare (``@idempotent``) or with the options of ``ViewOptions``; an option left out (or
    ``None``) follows its ``IDEMPOTENCY`` setting, read on each request. In lease mode,
    ``recover(request, key=..., attempt=...)`` is asked, before a key whose earlier request did
    not finish runs again, for the response to store if the effect already happened.
    For a class-based view, decorate ``as_view()`` or use
    ``method_decorator(idempotent, name="dispatch")``.
    """
    check_option_names(options)

    def decorator(view_func: ViewFunction) -> ViewFunction:
        if _is_drf_view(view_func):
            msg = (
                f"@idempotent on {view_func.__name__} would run before Django REST framework "
                "authenticates the request, scoping every key to an anonymous user. Use "
                "django_idempotency.drf.IdempotentMixin on DRF views instead."
            )
            raise ImproperlyConfigured(msg)

        def answer(request: HttpRequest, view: Callable[[], HttpResponseBase]) -> HttpResponseBase:
            policy = Policy.from_settings(recover, **options)
            return handle(
                request, view, engine=engine or default_engine, policy=policy, sender=view_func
            )

        if iscoroutinefunction(view_func):

            @wraps(view_func)
            async def async_wrapper(
                request: HttpRequest, *args: Any, **kwargs: Any
            ) -> HttpResponseBase:
                body = partial(view_func, request, *args, **kwargs)
                return await around_async(partial(answer, request), body)

            async_answered = answers_unavailable(async_wrapper)
            hooks.register(async_answered, options.get("reconcile"))
            async_answered.idempotency_options = options  # type: ignore[attr-defined] # checked at startup
            return async_answered  # type: ignore[return-value] # awaited by Django

        @wraps(view_func)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            return answer(request, lambda: view_func(request, *args, **kwargs))

        answered = answers_unavailable(wrapper)
        hooks.register(answered, options.get("reconcile"))
        answered.idempotency_options = options  # type: ignore[attr-defined] # checked at startup
        return answered

    return decorator if view is None else decorator(view)


def _is_drf_view(view_func: ViewFunction) -> bool:
    if not installed("rest_framework"):
        return False
    from rest_framework.views import APIView  # noqa: PLC0415 - DRF is optional

    view_class = getattr(view_func, "cls", None)
    return isinstance(view_class, type) and issubclass(view_class, APIView)


def conditional(
    queryset: QuerySet[Any],
    *,
    version_field: str | None = None,
    etag: Callable[[Model], str] | None = None,
    lookup_field: str = "pk",
    lookup_url_kwarg: str | None = None,
    required: bool = False,
) -> Callable[[ViewFunction], ViewFunction]:
    """Give a plain view of one object a strong ``ETag`` and make its updates conditional.

    The object is ``queryset``'s row whose ``lookup_field`` is the URL argument
    ``lookup_url_kwarg`` (by default, of the same name). Its ETag is its ``version_field`` (an
    integer the decorator adds one to, with a compare-and-set, before each ``PUT``, ``PATCH`` or
    ``DELETE`` runs the view) or what ``etag(obj)`` returns (a quoted strong ETag: build it with
    ``etag_for_version`` or ``etag_for_content`` from ``django_idempotency.conditional``); with
    ``etag``, the row is locked (``SELECT … FOR UPDATE``) from the check to the commit instead.
    The view runs in the same transaction, which rolls back if it answers an error. Answers as
    ``ConditionalMixin`` does: ``304``, ``412 precondition.failed``, ``428 precondition.required``
    (when ``required``) and ``400 precondition.invalid``.
    """
    if (version_field is None) == (etag is None):
        msg = "@conditional needs exactly one of version_field and etag."
        raise ImproperlyConfigured(msg)
    url_kwarg = lookup_url_kwarg or lookup_field

    def current_etag(instance: Model | None) -> str | None:
        if instance is None:
            return None
        if etag is not None:
            return etag(instance)
        return etag_for_version(getattr(instance, version_field))  # type: ignore[arg-type] # set

    def decorator(view_func: ViewFunction) -> ViewFunction:
        if iscoroutinefunction(view_func):
            msg = f"@conditional supports synchronous views only; {view_func.__name__} is async."
            raise ImproperlyConfigured(msg)

        @wraps(view_func)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            rows = queryset.filter(**{lookup_field: kwargs[url_kwarg]})
            if request.method not in CONDITIONAL_METHODS:
                tag = current_etag(rows.first())
                answer = check_preconditions(request, tag)
                if answer is not None:
                    return answer
                response = view_func(request, *args, **kwargs)
                if tag is not None and 200 <= response.status_code < 300:
                    response.headers.setdefault("ETag", tag)
                return response
            using = router.db_for_write(queryset.model)
            with transaction.atomic(using=using):
                if etag is not None:
                    rows = rows.select_for_update()
                instance = rows.first()
                answer = check_preconditions(request, current_etag(instance), required=required)
                if answer is not None:
                    return answer
                if instance is not None and version_field is not None:
                    try:
                        expected = names_a_version(request)
                        advance_version(instance, version_field, expected=expected)
                    except PreconditionError as error:
                        return error.response
                response = view_func(request, *args, **kwargs)
                if response.status_code >= 400:
                    transaction.set_rollback(True, using=using)
                elif request.method != "DELETE" and instance is not None:
                    tag = current_etag(rows.first())
                    if tag is not None:
                        response.headers.setdefault("ETag", tag)
            return response

        return wrapper

    return decorator
