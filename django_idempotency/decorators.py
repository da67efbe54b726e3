"""``@idempotent`` for plain Django views."""

from __future__ import annotations

from functools import wraps
from inspect import iscoroutinefunction
from typing import TYPE_CHECKING, Any, overload

from django.core.exceptions import ImproperlyConfigured

from django_idempotency.engine import Engine, Policy, default_engine

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from datetime import timedelta

    from django.http import HttpRequest, HttpResponseBase

    from django_idempotency.engine import Recover

    ViewFunction = Callable[..., HttpResponseBase]


@overload
def idempotent(view: ViewFunction, /) -> ViewFunction: ...
@overload
def idempotent(
    *,
    required: bool | None = None,
    methods: Iterable[str] | None = None,
    ttl: timedelta | float | None = None,
    wait_timeout: float | None = None,
    scope_function: Callable[[Any, str], str] | str | None = None,
    fingerprint_headers: Iterable[str] | None = None,
    retryable_status_codes: Iterable[int] | None = None,
    mode: str | None = None,
    lease_timeout: timedelta | float | None = None,
    recover: Recover | None = None,
    engine: Engine | None = None,
) -> Callable[[ViewFunction], ViewFunction]: ...
def idempotent(
    view: ViewFunction | None = None,
    /,
    *,
    required: bool | None = None,
    methods: Iterable[str] | None = None,
    ttl: timedelta | float | None = None,
    wait_timeout: float | None = None,
    scope_function: Callable[[Any, str], str] | str | None = None,
    fingerprint_headers: Iterable[str] | None = None,
    retryable_status_codes: Iterable[int] | None = None,
    mode: str | None = None,
    lease_timeout: timedelta | float | None = None,
    recover: Recover | None = None,
    engine: Engine | None = None,
) -> ViewFunction | Callable[[ViewFunction], ViewFunction]:
    """Make a view's unsafe methods idempotent by ``Idempotency-Key``.

    Use bare (``@idempotent``) or with per-view options; an option left at ``None`` follows the
    ``IDEMPOTENCY`` setting of the same name, read on each request. In lease mode,
    ``recover(request, key=..., attempt=...)`` is asked, before a key whose earlier request did
    not finish runs again, for the response to store if the effect already happened.
    For a class-based view, decorate ``as_view()`` or use
    ``method_decorator(idempotent, name="dispatch")``.
    """

    def decorator(view_func: ViewFunction) -> ViewFunction:
        if iscoroutinefunction(view_func):
            msg = f"@idempotent supports synchronous views only; {view_func.__name__} is async."
            raise ImproperlyConfigured(msg)
        if _is_drf_view(view_func):
            msg = (
                f"@idempotent on {view_func.__name__} would run before Django REST framework "
                "authenticates the request, scoping every key to an anonymous user. Use "
                "django_idempotency.drf.IdempotentMixin on DRF views instead."
            )
            raise ImproperlyConfigured(msg)

        @wraps(view_func)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            policy = Policy.from_settings(
                required=required,
                methods=methods,
                ttl=ttl,
                wait_timeout=wait_timeout,
                scope_function=scope_function,
                fingerprint_headers=fingerprint_headers,
                retryable_status_codes=retryable_status_codes,
                mode=mode,
                lease_timeout=lease_timeout,
                recover=recover,
            )
            return (engine or default_engine).handle(
                request,
                lambda: view_func(request, *args, **kwargs),
                policy=policy,
                sender=view_func,
            )

        return wrapper

    return decorator if view is None else decorator(view)


def _is_drf_view(view_func: ViewFunction) -> bool:
    try:
        from rest_framework.views import APIView  # noqa: PLC0415 - DRF is optional
    except ImportError:  # pragma: no cover - DRF is installed wherever the tests run
        return False
    view_class = getattr(view_func, "cls", None)
    return isinstance(view_class, type) and issubclass(view_class, APIView)
