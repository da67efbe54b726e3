"""The webhook receiver: a base view, configured per sender with a few attributes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.db import DataError, IntegrityError, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from django_idempotency import problems, signals
from django_idempotency.core.bodies import (
    JSONNotStandard,
    JSONTooDeep,
    check_json_depth,
    length_unknown,
    load_json,
    max_json_depth,
)
from django_idempotency.core.text import storable
from django_idempotency.core.unavailable import answers_unavailable
from django_idempotency.inbox.processing import ProcessResult
from django_idempotency.inbox.receiving import receive
from django_idempotency.signing import SignatureError

if TYPE_CHECKING:
    from collections.abc import Callable

    from django_idempotency.inbox.verifiers import Verifier

logger = logging.getLogger("django_idempotency.inbox")


class WebhookReceiverView(View):
    """Receive one sender's webhooks: verify, record once, then process.

    Set ``source`` and ``verifier``; the other attributes say where the event's id and type
    are. A duplicate delivery answers 200 and is not processed again.
    """

    http_method_names = ["post"]

    #: Names the sender; events are unique per (source, event id).
    source: str = ""
    #: Checks the request's signature before anything is written; see ``get_verifier()``.
    verifier: Verifier | None = None
    #: The payload field that holds the event id; its absence dedupes by payload hash.
    event_id_field: str | None = "id"
    #: A header that holds the event id instead (GitHub: "X-GitHub-Delivery").
    event_id_header: str | None = None
    #: The payload field that holds the event type.
    event_type_field: str | None = "type"
    #: A header that holds the event type instead (GitHub: "X-GitHub-Event").
    event_type_header: str | None = None
    #: Request headers stored with the event. Never list one that carries a secret.
    #: The correlation id's headers let the event's handlers log with the sender's id.
    kept_headers: tuple[str, ...] = (
        "Content-Type",
        "User-Agent",
        "X-Correlation-ID",
        "X-Request-ID",
    )
    #: Larger payloads are refused with 413 before they are read.
    max_payload_size: int = 1024 * 1024

    @classmethod
    def as_view(cls, **initkwargs: Any) -> Callable[..., HttpResponseBase]:
        # At URLconf import rather than at the first delivery: a misconfigured receiver should
        # stop the deploy, not answer 500 to every webhook.
        source = initkwargs.get("source", cls.source)
        if not source or len(source) > 100:
            msg = f"{cls.__name__} needs a source of 1 to 100 characters."
            raise ImproperlyConfigured(msg)
        overridden = cls.get_verifier is not WebhookReceiverView.get_verifier
        if initkwargs.get("verifier", cls.verifier) is None and not overridden:
            msg = f"{cls.__name__} needs a verifier, or a get_verifier() method."
            raise ImproperlyConfigured(msg)
        # Around the view function, once, rather than method_decorator() on dispatch(), which
        # decorates again at every request (0.02 ms of a delivery's Python).
        # A sender signs, it has no CSRF token. A database that is unavailable answers the
        # retryable 503 that every view answers: the sender delivers the event again. The
        # event is recorded in a commit of its own, before it is processed in transactions of
        # its own: under ATOMIC_REQUESTS a failed handler would roll the record back with it,
        # and the processing's row lock and effects would wait for the response.
        view = transaction.non_atomic_requests(super().as_view(**initkwargs))
        return csrf_exempt(answers_unavailable(view))

    def get_verifier(self) -> Verifier:
        """Return the verifier of this sender's signatures."""
        assert self.verifier is not None  # noqa: S101 - as_view() made sure
        return self.verifier

    def parse_payload(self, body: bytes) -> Any:
        """Return the payload of ``body``; raise ``ValueError`` if it cannot be read."""
        return load_json(body)

    def get_event_id(self, request: HttpRequest, payload: Any) -> str | None:
        """Return the sender's id of the event, or ``None`` to dedupe by payload hash."""
        if self.event_id_header:
            return request.headers.get(self.event_id_header)
        if self.event_id_field and isinstance(payload, dict):
            value = payload.get(self.event_id_field)
            return None if value is None else str(value)
        return None

    def get_event_type(self, request: HttpRequest, payload: Any) -> str:
        """Return the event's type, which picks its handler."""
        if self.event_type_header:
            return request.headers.get(self.event_type_header, "")
        if self.event_type_field and isinstance(payload, dict):
            return str(payload.get(self.event_type_field, ""))
        return ""

    def get_kept_headers(self, request: HttpRequest) -> dict[str, str]:
        """Return the request headers to store with the event."""
        return {name: value for name in self.kept_headers if (value := request.headers.get(name))}

    def post(self, request: HttpRequest) -> HttpResponse:
        try:
            payload, event_id, event_type = self._read(request)
        except _Refusal as refusal:
            logger.warning(
                "refused a %s webhook: %s",
                self.source,
                refusal.problem.code,
                extra={
                    "idempotency_source": self.source,
                    "idempotency_outcome": refusal.problem.code,
                },
            )
            signals.send_robustly(
                signals.inbox_delivery_refused,
                type(self),
                source=self.source,
                reason=refusal.problem.code,
            )
            return problems.problem_response(refusal.problem, refusal.detail)
        try:
            receipt = receive(
                self.source, event_id, event_type, payload, headers=self.get_kept_headers(request)
            )
        except (DataError, IntegrityError):
            # PostgreSQL refuses some valid JSON, such as "\u0000" in a string, and MariaDB's
            # JSON check refuses nesting deeper than 31 levels (which a MAX_JSON_DEPTH above the
            # default lets through, W007): delivering it again would not help. (A duplicate is
            # no IntegrityError: the insert does nothing then.)
            return problems.problem_response(
                problems.PAYLOAD_INVALID, "The payload cannot be stored."
            )
        if receipt.conflict:
            return problems.problem_response(
                problems.EVENT_CONFLICT, "The event id was recorded with another payload first."
            )
        status = "duplicate" if not receipt.created else (receipt.outcome or "queued")
        # Recorded, then the attempt in this request failed (the handler raised, or the
        # database went away): from here the retries are the inbox's. A 5xx would only bring
        # a duplicate delivery, and senders disable an endpoint that keeps answering 5xx.
        failed = receipt.outcome in (ProcessResult.FAILED, ProcessResult.DEAD)
        return JsonResponse({"status": status}, status=202 if failed else 200)

    def _read(self, request: HttpRequest) -> tuple[Any, str | None, str]:
        """Return the verified payload, event id and type; raise ``_Refusal`` if there are none."""
        too_large = _Refusal(problems.PAYLOAD_TOO_LARGE, "The payload exceeds the limit.")
        if _content_length(request) > self.max_payload_size:
            raise too_large
        if length_unknown(request):
            # Django would read an empty body, and the signature would not match it.
            raise _Refusal(
                problems.PAYLOAD_LENGTH_REQUIRED,
                "The payload was sent without Content-Length, so it cannot be read whole.",
            )
        try:
            # Django reads no more than Content-Length.
            body = request.body
        except RequestDataTooBig:
            raise too_large from None
        try:
            self.get_verifier().verify(request.headers, body)
        except SignatureError as exc:
            raise _Refusal(problems.BY_CODE[exc.code], exc.detail) from None
        try:
            payload = self.parse_payload(body)
            if type(self).parse_payload is not WebhookReceiverView.parse_payload:
                # A parse_payload() of the project's own: its payload's depth is checked here
                # (load_json checked the default's), as storing and hashing it recurse through it.
                check_json_depth(payload)
        except (JSONTooDeep, RecursionError):
            detail = f"The payload is nested deeper than {max_json_depth()} levels."
            raise _Refusal(problems.PAYLOAD_INVALID, detail) from None
        except JSONNotStandard as exc:
            raise _Refusal(problems.PAYLOAD_INVALID, f"The payload {exc}.") from None
        except ValueError:
            raise _Refusal(problems.PAYLOAD_INVALID, "The payload cannot be parsed.") from None
        event_id = self.get_event_id(request, payload)
        if event_id is not None and not 0 < len(event_id) <= 255:
            raise _Refusal(problems.PAYLOAD_INVALID, "The event id must be 1 to 255 long.")
        event_type = self.get_event_type(request, payload)[:255]
        for name, value in (("id", event_id), ("type", event_type)):
            if value is not None and not storable(value):
                raise _Refusal(problems.PAYLOAD_INVALID, f"The event {name} is not valid text.")
        return payload, event_id, event_type

    def http_method_not_allowed(
        self, request: HttpRequest, *args: Any, **kwargs: Any
    ) -> HttpResponse:
        response = problems.problem_response(
            problems.METHOD_NOT_ALLOWED, "Deliver webhooks with POST."
        )
        response["Allow"] = "POST"
        return response


class _Refusal(Exception):
    def __init__(self, problem: problems.Problem, detail: str) -> None:
        self.problem, self.detail = problem, detail


def _content_length(request: HttpRequest) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        # Refused here: Django 5.2 raises ValueError on reading such a body, 6.1 reads it as empty.
        raise _Refusal(problems.PAYLOAD_INVALID, "The Content-Length is not valid.") from None
