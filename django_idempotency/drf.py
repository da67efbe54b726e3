"""Django REST framework adapters: ``IdempotentMixin``, ``ConditionalMixin`` and ``JSONParser``."""

from __future__ import annotations

import inspect
import json
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import router, transaction

from django_idempotency.core import hooks, optional

__all__ = ["ConditionalMixin", "IdempotentMixin", "JSONParser"]

with optional.requires("drf", __name__):
    from rest_framework import parsers
    from rest_framework.exceptions import ParseError
    from rest_framework.utils.encoders import JSONEncoder

from django_idempotency.conditional import (
    CONDITIONAL_METHODS,
    PreconditionError,
    advance_version,
    check_preconditions,
    etag_for_content,
    etag_for_version,
    names_a_version,
)
from django_idempotency.conf import UNSAFE_METHODS, idempotency_settings, resolve_callable
from django_idempotency.core.bodies import JSONTooDeep, check_json_depth, max_json_depth
from django_idempotency.core.engine import Engine, default_engine
from django_idempotency.core.fingerprint import buffer_body
from django_idempotency.core.keyed_request import handle
from django_idempotency.core.unavailable import DATABASE_UNAVAILABLE, unavailable_answer
from django_idempotency.policy import SETTING_OF, Policy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from datetime import timedelta
    from typing import IO

    from django.db.models import Model, QuerySet
    from django.http import HttpRequest, HttpResponseBase
    from rest_framework.generics import GenericAPIView
    from rest_framework.request import Request
    from rest_framework.serializers import BaseSerializer
    from rest_framework.views import APIView

    _Base = APIView
    _GenericBase = GenericAPIView
else:
    _Base = object
    _GenericBase = object


# APIView, named rather than imported: rest_framework.views reads DEFAULT_PARSER_CLASSES on
# import, and that setting may name this module's JSONParser.
_DRF_DISPATCH = "rest_framework.views.APIView"


class _Dispatch(_Base):
    """DRF's ``APIView.dispatch``, with the call of the handler open to the mixins.

    DRF calls the handler straight after ``initial()``, with no hook between. This is its
    dispatch step for step, but the handler is called through ``_respond()``, which
    ``IdempotentMixin`` runs under the request's key, and within it ``_call_handler()``, which
    ``ConditionalMixin`` runs in a transaction: they nest the same whatever the order of the
    bases, after every ``initial()``, around the handler alone.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        after = (klass for klass in mro[mro.index(_Dispatch) + 1 :] if "dispatch" in vars(klass))
        skipped = next(after, None)
        if skipped is not None and f"{skipped.__module__}.{skipped.__qualname__}" != _DRF_DISPATCH:
            mixin = next(klass.__name__ for klass in mro if klass.__module__ == __name__)
            msg = (
                f"{cls.__qualname__}: {skipped.__qualname__}.dispatch() would not run, as it "
                f"comes after {mixin} in the bases, whose dispatch() takes DRF's steps itself. "
                f"Override dispatch() in {cls.__qualname__}, or in a mixin before {mixin}."
            )
            raise ImproperlyConfigured(msg)

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        self.args = args
        self.kwargs = kwargs
        drf_request = self.initialize_request(request, *args, **kwargs)
        self.request = drf_request
        self.headers = self.default_response_headers
        response: HttpResponseBase
        try:
            self.initial(drf_request, *args, **kwargs)
            method = (drf_request.method or "").lower()
            handler = getattr(self, method, None) if method in self.http_method_names else None
            if handler is None:
                response = self.http_method_not_allowed(drf_request, *args, **kwargs)
            else:
                response = self._respond(drf_request, handler, *args, **kwargs)
        except Exception as exc:
            response = self.handle_exception(exc)
        # finalize_response takes any HttpResponseBase, though typed for Response.
        self.response = self.finalize_response(drf_request, response, *args, **kwargs)  # type: ignore[arg-type]
        return self.response

    def _respond(
        self, request: Request, handler: Callable[..., HttpResponseBase], *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        """Answer ``request`` with ``handler``; ``IdempotentMixin`` answers under the key."""
        return self._call_handler(request, handler, *args, **kwargs)

    def _call_handler(
        self, request: Request, handler: Callable[..., HttpResponseBase], *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        """Call ``handler``; ``ConditionalMixin`` calls it in a transaction."""
        return handler(request, *args, **kwargs)


def _unbound(view: object, name: str) -> Any:
    """The attribute ``name`` of ``view`` as stored, on it or its class: a plain function stays
    a function, not a bound method."""
    for namespace in (vars(view), *(vars(cls) for cls in type(view).__mro__)):
        if name in namespace:
            return namespace[name]
    raise AttributeError(name)


class IdempotentMixin(_Dispatch):
    """Make a view's unsafe methods idempotent by the ``Idempotency-Key`` header.

    Put it before the DRF view class: ``class PaymentView(IdempotentMixin, CreateAPIView)``.
    The key is resolved after authentication, permissions and throttling, so a replay passes
    those checks too. Every ``idempotency_*`` attribute left at ``None`` follows the
    ``IDEMPOTENCY`` setting of the same name; all are read on each request.
    """

    idempotency_required: bool | None = None
    idempotency_methods: Iterable[str] | None = None
    idempotency_ttl: timedelta | float | None = None
    idempotency_wait_timeout: float | None = None
    idempotency_scope_function: Callable[[Any, str], str] | str | None = None
    idempotency_fingerprint_headers: Iterable[str] | None = None
    idempotency_retryable_status_codes: Iterable[int] | None = None
    idempotency_invalid_request_status_codes: Iterable[int] | None = None
    idempotency_mode: str | None = None
    idempotency_lease_timeout: timedelta | float | None = None
    idempotency_reconcile: Callable[[Any], Any] | str | None = None
    idempotency_engine: Engine = default_engine

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The sweeper finds the view's hook in the registry: declared with the class.
        hook = inspect.getattr_static(cls, "idempotency_reconcile", None)
        hooks.register(cls, hook.__func__ if isinstance(hook, staticmethod) else hook)

    def get_idempotency_policy(self) -> Policy:
        """Return the policy for this request; override to decide per request."""
        options = {
            name: getattr(self, f"idempotency_{name}")
            for name in SETTING_OF
            if name != "scope_function"
        }
        return Policy.from_settings(
            recover=self._recover, scope_function=self.get_idempotency_scope, **options
        )

    def get_idempotency_scope(self, request: Request, route: str) -> str:
        """The scope of this request's keys: two requests share a key only within one scope.

        By default ``idempotency_scope_function``, else the ``SCOPE_FUNCTION`` setting; override
        to scope keys by tenant, say, with ``self`` and the authenticated ``request`` at hand.
        """
        # A plain function stored on the class must not become a method.
        function = _unbound(self, "idempotency_scope_function")
        if function is None:
            return idempotency_settings.SCOPE_FUNCTION(request, route)
        scope = resolve_callable(function, f"{type(self).__name__}.idempotency_scope_function")
        return str(scope(request, route))

    def recover_idempotent_request(
        self, request: Request, *, key: str, attempt: int
    ) -> HttpResponseBase | None:
        """Lease mode: an earlier request with ``key`` did not finish; did its effect happen?

        Ask the downstream (the payment provider, by ``key.downstream_key``, which the view gave
        it) and return the response to store if the effect happened, or ``None`` to run the
        view again.
        """
        return None

    def _recover(self, request: Request, *, key: str, attempt: int) -> HttpResponseBase | None:
        response = self.recover_idempotent_request(request, key=key, attempt=attempt)
        if response is None:
            return None
        return self.finalize_response(request, response)  # type: ignore[arg-type]

    def handle_exception(self, exc: Exception) -> HttpResponseBase:  # type: ignore[override] # DRF finalizes any HttpResponseBase
        # The database can fail before the handler runs too (authentication queries it after
        # a failover): the one retryable 503, never a bare 500. DRF hands every error of the
        # view here, where other adapters wrap the view.
        if (unavailable := unavailable_answer(exc)) is not None:
            return unavailable
        return super().handle_exception(exc)

    def initialize_request(self, request: HttpRequest, *args: Any, **kwargs: Any) -> Request:
        if request.method in UNSAFE_METHODS and idempotency_settings.HEADER in request.headers:
            # Authentication, a permission or any initial() may read request.data, which can
            # stream the body away before the fingerprint is taken.
            buffer_body(request)
        return super().initialize_request(request, *args, **kwargs)

    def _respond(
        self, request: Request, handler: Callable[..., HttpResponseBase], *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        respond = super()._respond
        # Safe methods are never idempotent by key: leave them untouched, and cost nothing.
        if request.method not in UNSAFE_METHODS:
            return respond(request, handler, *args, **kwargs)

        def run_view() -> HttpResponseBase:
            # Turn DRF exceptions into their responses here, inside the transaction, so a
            # deterministic 4xx is stored and replayed like any other answer.
            try:
                response = respond(request, handler, *args, **kwargs)
            except DATABASE_UNAVAILABLE:
                raise  # the engine rolls back, reports it and answers 503
            except Exception as exc:
                response = self.handle_exception(exc)
            # finalize_response takes any HttpResponseBase, though typed for Response.
            return self.finalize_response(request, response, *args, **kwargs)  # type: ignore[arg-type]

        return handle(
            request._request,
            run_view,
            engine=self.idempotency_engine,
            policy=self.get_idempotency_policy(),
            sender=type(self),
            view_request=request,
        )


def _view_class(callback: Any) -> list[tuple[None, Any]]:
    # A viewset's as_view() names its class as DRF's cls alone, not as Django's view_class.
    view_class = getattr(callback, "cls", None)
    return [] if view_class is None else [(None, view_class)]


hooks.register_reader(_view_class)


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, refusing JSON nested deeper than the ``MAX_JSON_DEPTH`` setting allows
    with a ``ParseError`` (400), where DRF's own answers 500 (a ``RecursionError``) or passes it
    on to a database that refuses it.

    Set it first in ``DEFAULT_PARSER_CLASSES``, or in a view's ``parser_classes``.
    """

    def parse(
        self,
        stream: IO[Any],
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        try:
            return check_json_depth(super().parse(stream, media_type, parser_context))
        except (JSONTooDeep, RecursionError):
            msg = f"JSON parse error - nested deeper than {max_json_depth()} levels"
            raise ParseError(msg) from None


class ConditionalMixin(_Dispatch, _GenericBase):  # type: ignore[type-arg] # any model
    """Give a detail view a strong ``ETag``, and make its updates conditional on ``If-Match``.

    Put it before the generic view class: ``class PaymentDetail(ConditionalMixin,
    RetrieveUpdateDestroyAPIView)``. ``GET`` and ``HEAD`` answer with the ``ETag`` (and ``304``
    to a matching ``If-None-Match``); ``PUT``, ``PATCH`` and ``DELETE`` with an ``If-Match`` that
    does not match the current ``ETag`` answer ``412 precondition.failed``, and without
    ``If-Match`` they answer ``428 precondition.required`` when ``precondition_required`` is set.

    The ETag is the ``etag_version_field`` column (an integer the mixin adds one to on each
    update, with a compare-and-set) or, without one, a hash of the serialized representation,
    read under a row lock (``SELECT … FOR UPDATE``) held until the update commits. Either way,
    of two updates sent with the same ``If-Match``, one succeeds and the other gets a 412.
    """

    etag_version_field: str | None = None
    precondition_required: bool = False

    _lock_for_update = False
    _conditional_instance: Model | None = None

    def get_etag(self, instance: Model) -> str:
        """Return the strong ETag of ``instance``'s current state."""
        if self.etag_version_field is not None:
            return etag_for_version(getattr(instance, self.etag_version_field))
        return self._etag_of_data(self.get_serializer(instance).data)

    @staticmethod
    def _etag_of_data(data: Any) -> str:
        # The data, not the rendered bytes: the browsable API and JSON give the same ETag.
        return etag_for_content(json.dumps(data, cls=JSONEncoder).encode())

    def _call_handler(
        self, request: Request, handler: Callable[..., HttpResponseBase], *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        call = super()._call_handler
        if request.method not in CONDITIONAL_METHODS:
            return call(request, handler, *args, **kwargs)
        # The check and the write commit together (a savepoint inside an outer transaction),
        # inside the key's transaction, or after a lease-mode key's claim has committed.
        with transaction.atomic(using=router.db_for_write(self.get_queryset().model)):
            return call(request, handler, *args, **kwargs)

    def filter_queryset(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        queryset = super().filter_queryset(queryset)
        if self._lock_for_update:
            features = transaction.get_connection(queryset.db).features
            # Lock this model's row only, not rows of tables joined by select_related.
            of = ("self",) if features.has_select_for_update_of else ()
            queryset = queryset.select_for_update(of=of)
        return queryset

    def get_object(self) -> Any:
        unsafe = self.request.method in CONDITIONAL_METHODS
        self._lock_for_update = unsafe and self.etag_version_field is None
        try:
            instance = super().get_object()
        finally:
            self._lock_for_update = False
        if unsafe:
            answer = check_preconditions(
                self.request._request,
                self.get_etag(instance),
                required=self.precondition_required,
            )
            if answer is not None:
                raise PreconditionError(answer)
        self._conditional_instance = instance
        return instance

    def perform_update(self, serializer: BaseSerializer[Any]) -> None:
        """Advance the version (a compare-and-set when ``If-Match`` was given), then save."""
        if self.etag_version_field is not None:
            instance = self._conditional_instance
            assert instance is not None, "get_object() ran first"  # noqa: S101 - an invariant
            advance_version(
                instance, self.etag_version_field, expected=names_a_version(self.request._request)
            )
        super().perform_update(serializer)  # type: ignore[misc] # UpdateModelMixin's

    def perform_destroy(self, instance: Model) -> None:
        """Claim the version with a compare-and-set when ``If-Match`` was given, then delete."""
        if self.etag_version_field is not None and names_a_version(self.request._request):
            advance_version(instance, self.etag_version_field, expected=True)
        super().perform_destroy(instance)  # type: ignore[misc] # DestroyModelMixin's

    def handle_exception(self, exc: Exception) -> HttpResponseBase:  # type: ignore[override] # DRF finalizes any HttpResponseBase
        if isinstance(exc, PreconditionError):
            return exc.response
        return super().handle_exception(exc)

    def finalize_response(  # type: ignore[override] # a 304 is not a DRF Response
        self, request: Request, response: HttpResponseBase, *args: Any, **kwargs: Any
    ) -> HttpResponseBase:
        response = super().finalize_response(request, response, *args, **kwargs)  # type: ignore[arg-type]
        instance = self._conditional_instance
        if (
            instance is None
            or not 200 <= response.status_code < 300
            or request.method not in {"GET", "HEAD", "PUT", "PATCH"}
            or response.has_header("ETag")
        ):
            return response
        data = getattr(response, "data", None)
        if self.etag_version_field is None and data is not None:
            etag = self._etag_of_data(data)  # what get_etag would give, without serializing twice
        else:
            etag = self.get_etag(instance)
        response["ETag"] = etag
        if request.method in {"GET", "HEAD"}:
            return check_preconditions(request._request, etag, response=response) or response
        return response
