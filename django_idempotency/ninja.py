"""Django Ninja adapter: ``@idempotent`` for Ninja operations.

Put it under the operation's decorator::

    @router.post("/payments/", response={201: PaymentOut})
    @idempotent()
    def create_payment(request, payload: PaymentIn): ...

The key is resolved after Ninja's authentication, throttling and input validation: the scope
has the principal that authenticated, and a request that Ninja rejects as invalid (its ``422``)
never claims the key, so the corrected retry with the same key runs. The operation's result
(or the ``HttpError`` it raises) becomes its response inside the engine's transaction, so a
business ``4xx`` is stored and replayed like any other answer. The operation documents the
``Idempotency-Key`` header and the problem answers in Ninja's OpenAPI schema.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from functools import partial, wraps
from typing import TYPE_CHECKING, Any, overload

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Model
from django.http import HttpResponseBase

from django_idempotency.core import deprecation, hooks, optional

with optional.requires("ninja", __name__):
    from ninja.decorators import decorate_view
    from ninja.utils import contribute_operation_callback

from django_idempotency import problems
from django_idempotency.conf import idempotency_settings
from django_idempotency.core.engine import Engine, default_engine
from django_idempotency.core.keyed_request import around_async, handle
from django_idempotency.core.openapi_contract import (
    PROBLEM_NAME,
    PROBLEM_SCHEMA,
    SUCCESS_HEADERS,
    Answer,
    answers,
    key_parameter,
    problem_response,
)
from django_idempotency.core.unavailable import DATABASE_UNAVAILABLE, answers_unavailable
from django_idempotency.policy import Policy, check_option_names
from django_idempotency.scope import default_scope, get_principal

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from typing import Unpack

    from django.http import HttpRequest
    from ninja.operation import Operation

    from django_idempotency.policy import Recover, ViewOptions

    OperationFunction = Callable[..., Any]

# Where the operation that runs a request is kept, for the operation function to find: a
# router mounted twice runs two copies of one operation, each with its own API.
_OPERATION = "_django_idempotency_ninja_operation"

__all__ = ["idempotency_extra", "idempotent", "ninja_scope", "principal"]

if TYPE_CHECKING:
    from django_idempotency.problems import PROBLEM_MEDIA_TYPE  # noqa: F401 - deprecated here
else:
    # Its one home is django_idempotency.problems, which both frameworks' modules share.
    __getattr__ = deprecation.moved(__name__, {"PROBLEM_MEDIA_TYPE": "django_idempotency.problems"})

# Inline, as an operation's openapi_extra cannot add a component: named by its title. Its codes
# are in an enum too, which Ninja leaves inline (drf-spectacular would make it a component).
_PROBLEM_SCHEMA = {
    **PROBLEM_SCHEMA,
    "title": PROBLEM_NAME,
    "properties": {
        **PROBLEM_SCHEMA["properties"],
        "code": {**PROBLEM_SCHEMA["properties"]["code"], "enum": sorted(problems.BY_CODE)},
    },
}
# Ninja answers 422 itself to input its schema refuses: our 422's description says so.
_NINJA_422 = " Ninja answers 422 to invalid input too, before the key is claimed."


@overload
def idempotent(function: OperationFunction, /) -> OperationFunction: ...
@overload
def idempotent(
    *,
    recover: Recover | None = None,
    engine: Engine | None = None,
    **options: Unpack[ViewOptions],
) -> Callable[[OperationFunction], OperationFunction]: ...
def idempotent(
    function: OperationFunction | None = None,
    /,
    *,
    recover: Recover | None = None,
    engine: Engine | None = None,
    **options: Unpack[ViewOptions],
) -> OperationFunction | Callable[[OperationFunction], OperationFunction]:
    """Make a Ninja operation idempotent by ``Idempotency-Key``; put it under ``@router.post``.

    Takes the options of ``ViewOptions`` (one left out follows its ``IDEMPOTENCY`` setting, read
    on each request) and, in lease mode, ``recover(request, key=..., attempt=...)``, which may
    return a response or any result the operation could return.
    """
    check_option_names(options)

    def decorator(function: OperationFunction) -> OperationFunction:
        if hasattr(function, "_ninja_operation"):
            msg = (
                f"@idempotent on {function.__name__} is above the operation's decorator: put it "
                "under @api.post (or @router.post), next to the function."
            )
            raise ImproperlyConfigured(msg)
        adapter = _Adapter(recover, engine or default_engine, options)
        contribute_operation_callback(function, adapter.install)
        # A decorator of the operation's run (Ninja re-applies it to each mounted copy): it
        # tells the operation function which copy runs the request.
        return decorate_view(adapter.around_run)(function)

    return decorator if function is None else decorator(function)


class _Adapter:
    """What one ``@idempotent`` knows: its options, and how to run its operation's function."""

    def __init__(self, recover: Recover | None, engine: Engine, options: ViewOptions) -> None:
        self.recover = recover
        self.engine = engine
        self.options = options
        self.own_extra: dict[str, Any] = {}

    def policy(self, operation: Operation) -> Policy:
        recover = partial(self._recover, operation) if self.recover is not None else None
        options: ViewOptions = {**self.options}
        if options.get("scope_function") is None:
            options["scope_function"] = ninja_scope
        return Policy.from_settings(recover, **options)

    def _recover(
        self, operation: Operation, request: HttpRequest, *, key: str, attempt: int
    ) -> HttpResponseBase | None:
        assert self.recover is not None  # noqa: S101 - set when this is called
        result = self.recover(request, key=key, attempt=attempt)
        if result is None or isinstance(result, HttpResponseBase):
            return result
        temporal = operation.api.create_temporal_response(request)
        return operation._result_to_response(request, result, temporal)

    def install(self, operation: Operation) -> None:
        """Wrap the operation's function, which Ninja calls after authentication and parsing."""
        if getattr(operation, "stream_format", None) is not None:
            msg = f"@idempotent cannot store the streamed answers of {operation.path!r}."
            raise ImproperlyConfigured(msg)
        operation.view_func = self._wrap(operation.view_func)
        self.own_extra = dict(operation.openapi_extra or {})
        _document(operation, self)

    def around_run(self, run: Callable[..., Any]) -> Callable[..., Any]:
        operation: Operation = run.__self__  # type: ignore[attr-defined] # a bound method
        _document(operation, self)

        @wraps(run)
        def remembered(request: HttpRequest, **kwargs: Any) -> Any:
            setattr(request, _OPERATION, operation)
            return run(request, **kwargs)  # awaitable, if run is

        if iscoroutinefunction(run):
            markcoroutinefunction(remembered)
        return answers_unavailable(remembered)

    def _wrap(self, function: OperationFunction) -> OperationFunction:
        def answer(
            request: HttpRequest, operation: Operation, call: Callable[[], Any], values: Any
        ) -> HttpResponseBase:
            response_arg = operation.signature.response_arg
            temporal = values[response_arg] if response_arg else None
            if temporal is None:
                temporal = operation.api.create_temporal_response(request)

            def run_view() -> HttpResponseBase:
                # The result or the error becomes a response here, inside the transaction, so
                # a deterministic 4xx is stored and replayed like any other answer.
                try:
                    return operation._result_to_response(request, call(), temporal)
                except DATABASE_UNAVAILABLE:
                    raise  # the engine rolls back, reports it and answers 503
                except Exception as exc:
                    return operation.api.on_exception(request, exc)

            return handle(
                request,
                run_view,
                engine=self.engine,
                policy=self.policy(operation),
                sender=function,
            )

        if iscoroutinefunction(function):

            @wraps(function)
            async def async_function(request: HttpRequest, **values: Any) -> HttpResponseBase:
                operation = getattr(request, _OPERATION)
                body = partial(function, request, **values)
                return await around_async(
                    lambda call: answer(request, operation, call, values), body
                )

            hooks.register(async_function, self.options.get("reconcile"))
            async_function.idempotency_options = self.options  # type: ignore[attr-defined] # seen by the checks
            return async_function

        @wraps(function)
        def sync_function(request: HttpRequest, **values: Any) -> HttpResponseBase:
            operation = getattr(request, _OPERATION)
            return answer(request, operation, partial(function, request, **values), values)

        hooks.register(sync_function, self.options.get("reconcile"))
        sync_function.idempotency_options = self.options  # type: ignore[attr-defined] # seen by the checks
        return sync_function


def ninja_operations(callback: Any) -> list[Operation]:
    """The operations of a Django Ninja path, one per method, behind its URL pattern's view.

    Ninja's view is a closure over its ``PathView``, and nothing public leads from the view to
    it: what else would tell the sweeper and the checks, which serve no request, which function
    answers which method.
    """
    for cell in getattr(callback, "__closure__", None) or ():
        try:
            operations = getattr(cell.cell_contents, "operations", None)
        except ValueError:  # an empty cell
            continue
        if isinstance(operations, list):
            return operations
    return []


def _dispatched(callback: Any) -> Iterator[tuple[list[str], Any]]:
    for operation in ninja_operations(callback):
        yield operation.methods, operation.view_func


hooks.register_reader(_dispatched)


def ninja_scope(request: Any, route: str) -> str:
    """The scope of a Ninja request: the ``SCOPE_FUNCTION`` setting's, with Ninja's principal.

    With the default scope function, the principal is what Ninja's authentication returned
    (``request.auth``): a user or a model instance by its model and primary key, a token (a
    string) by its SHA-256 digest. Without one (or with ``True``), it is ``request.user``.
    """
    function = idempotency_settings.SCOPE_FUNCTION
    if function is not default_scope:
        return str(function(request, route))
    return f"{principal(request)} {request.method} {route}"


def principal(request: Any) -> str:
    """Name who Ninja authenticated for ``request``; the anonymous policy applies without."""
    auth = getattr(request, "auth", None)
    if auth is None or isinstance(auth, bool):  # True: let in, as nobody in particular
        return get_principal(request)
    if isinstance(auth, Model) or hasattr(auth, "is_authenticated"):
        if not getattr(auth, "is_authenticated", True):
            return get_principal(request)
        meta = getattr(auth, "_meta", None)
        kind = meta.label_lower if meta is not None else type(auth).__qualname__
        return f"{kind}:{auth.pk}"
    if isinstance(auth, str | bytes):
        value = auth.encode() if isinstance(auth, str) else auth
        return f"token:{hashlib.sha256(value).hexdigest()}"
    msg = (
        f"Cannot scope idempotency keys by a Ninja principal of type {type(auth).__name__}: "
        "return a user, a model instance or a token string from authenticate(), or give "
        "@idempotent a scope_function."
    )
    raise ImproperlyConfigured(msg)


def _document(operation: Operation, adapter: _Adapter) -> None:
    """Have Ninja's schema document the header and the answers, as the settings say then."""
    # Each mounted copy starts from the operation's own extra: Ninja copies the computed one.
    operation.openapi_extra = _SchemaExtra(operation, adapter, adapter.own_extra)


class _SchemaExtra(dict[str, Any]):
    """The operation's ``openapi_extra``: the operation's own, and what the key adds to it.

    Computed each time the schema is, so that it follows the settings as requests do.
    """

    def __init__(self, operation: Operation, adapter: _Adapter, own: dict[str, Any]) -> None:
        super().__init__()
        self.operation = operation
        self.adapter = adapter
        self.own = own

    def _value(self) -> dict[str, Any]:
        value = {**self.own}
        added = idempotency_extra(self.adapter.policy(self.operation), self.operation)
        for key, item in added.items():
            if isinstance(item, list):
                value[key] = [*value.get(key, []), *item]
            elif isinstance(item, dict):
                value[key] = {**item, **value.get(key, {})}
            else:
                value.setdefault(key, item)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._value())

    def __len__(self) -> int:
        return len(self._value())

    def __getitem__(self, key: str) -> Any:
        return self._value()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._value()

    def keys(self) -> Any:
        return self._value().keys()

    def items(self) -> Any:
        return self._value().items()

    def get(self, key: str, default: Any = None) -> Any:
        return self._value().get(key, default)


def idempotency_extra(policy: Policy, operation: Operation) -> dict[str, Any]:
    """The OpenAPI fragment for an operation under ``policy``: its header and answers."""
    if not {method.upper() for method in operation.methods} & policy.methods:
        return {}
    # By status as Ninja's schema has them (numbers), so that ours and the operation's merge.
    responses: dict[int, Any] = {
        answer.status: problem_response(_in_ninja(answer), _PROBLEM_SCHEMA) for answer in answers()
    }
    for status in operation.response_models:
        if isinstance(status, int) and 200 <= status < 300:
            responses[status] = {"headers": SUCCESS_HEADERS}
    return {"parameters": [key_parameter(policy)], "responses": responses}


def _in_ninja(answer: Answer) -> Answer:
    if answer.status == 422:
        return replace(answer, description=answer.description + _NINJA_422)
    return answer
