"""``IdempotentMixin`` for Django REST framework views and viewsets."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django_idempotency.conf import UNSAFE_METHODS, idempotency_settings
from django_idempotency.engine import (
    DATABASE_UNAVAILABLE,
    Engine,
    Policy,
    default_engine,
    unavailable_response,
)
from django_idempotency.fingerprint import buffer_body

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from datetime import timedelta

    from django.http import HttpResponseBase
    from rest_framework.request import Request
    from rest_framework.views import APIView

    _Base = APIView
else:
    _Base = object


class IdempotentMixin(_Base):
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
    idempotency_mode: str | None = None
    idempotency_lease_timeout: timedelta | float | None = None
    idempotency_engine: Engine = default_engine

    def get_idempotency_policy(self) -> Policy:
        """Return the policy for this request; override to decide per request."""
        return Policy.from_settings(
            required=self.idempotency_required,
            methods=self.idempotency_methods,
            ttl=self.idempotency_ttl,
            wait_timeout=self.idempotency_wait_timeout,
            # Read from the class: a plain function stored there must not become a method.
            scope_function=type(self).idempotency_scope_function,
            fingerprint_headers=self.idempotency_fingerprint_headers,
            retryable_status_codes=self.idempotency_retryable_status_codes,
            mode=self.idempotency_mode,
            lease_timeout=self.idempotency_lease_timeout,
            recover=self._recover,
        )

    def recover_idempotent_request(
        self, request: Request, *, key: str, attempt: int
    ) -> HttpResponseBase | None:
        """Lease mode: an earlier request with ``key`` did not finish; did its effect happen?

        Ask the downstream (the payment provider, by the idempotency key you gave it) and
        return the response to store if the effect happened, or ``None`` to run the view again.
        """
        return None

    def _recover(self, request: Request, *, key: str, attempt: int) -> HttpResponseBase | None:
        response = self.recover_idempotent_request(request, key=key, attempt=attempt)
        if response is None:
            return None
        return self.finalize_response(request, response)  # type: ignore[arg-type]

    def handle_exception(self, exc: Exception) -> HttpResponseBase:  # type: ignore[override] # DRF finalizes any HttpResponseBase
        # The database can fail before the handler runs too (authentication queries it after
        # a failover): that is a retryable 503, never a bare 500.
        if isinstance(exc, DATABASE_UNAVAILABLE):
            return unavailable_response(rolled_back=False)
        return super().handle_exception(exc)

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        if request.method in UNSAFE_METHODS and idempotency_settings.HEADER in request.headers:
            # Authentication or a permission may read request.data, which can stream the body
            # away before the fingerprint is taken.
            buffer_body(request._request)
        super().initial(request, *args, **kwargs)
        # Authentication, permissions and throttling have passed. APIView.dispatch looks the
        # handler up only now, so wrapping it on this (per-request) instance puts the engine
        # around the handler and nothing else.
        name = (request.method or "").lower()
        handler = getattr(self, name, None)
        # Safe methods are never idempotent by key: leave them untouched, and cost nothing.
        if request.method in UNSAFE_METHODS and handler is not None:
            setattr(self, name, self._idempotent_handler(handler))

    def _idempotent_handler(
        self, handler: Callable[..., HttpResponseBase]
    ) -> Callable[..., HttpResponseBase]:
        def idempotent_handler(request: Request, *args: Any, **kwargs: Any) -> HttpResponseBase:
            def run_view() -> HttpResponseBase:
                # Turn DRF exceptions into their responses here, inside the transaction, so a
                # deterministic 4xx is stored and replayed like any other answer.
                try:
                    response = handler(request, *args, **kwargs)
                except DATABASE_UNAVAILABLE:
                    raise  # the engine rolls back, reports it and answers 503
                except Exception as exc:
                    response = self.handle_exception(exc)
                # finalize_response takes any HttpResponseBase, though typed for Response.
                return self.finalize_response(request, response, *args, **kwargs)  # type: ignore[arg-type]

            return self.idempotency_engine.handle(
                request._request,
                run_view,
                policy=self.get_idempotency_policy(),
                sender=type(self),
                view_request=request,
            )

        return idempotent_handler
