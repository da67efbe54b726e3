"""The payments API's async views: plain Django ``async def`` views with ``@idempotent``.

``POST /async/payments/`` takes a payment as ``POST /api/payments/`` does, and
``POST /async/charges/`` charges a card as ``POST /api/charges/`` does, in lease mode. Each awaits
the provider on the event loop, and its queries (Django's async ORM) join the transaction that
holds the key: the payment and its ledger entry commit with the stored response, or not at all.
Serve them with an ASGI server (``example_project.asgi``); under WSGI they work too, one request
per thread.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from functools import wraps
from typing import TYPE_CHECKING, Any

from django.contrib.auth import aauthenticate
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.decorators import idempotent
from django_idempotency.keys import key_of
from payments import provider
from payments.models import LedgerEntry, Payment
from payments.serializers import PaymentSerializer

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from django.http import HttpResponseBase

    from django_idempotency.keys import ScopedKey

    AsyncView = Callable[..., Awaitable[HttpResponseBase]]


def authenticated(view: AsyncView) -> AsyncView:
    """Let in a user who sends HTTP Basic credentials or has a session; answer 401 otherwise.

    It goes above ``@idempotent``: the key is scoped to the user, so the user must be known
    before the key is looked at.
    """

    @wraps(view)
    async def checked(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        user = await _basic_user(request) or await request.auser()
        if not user.is_authenticated:
            response = JsonResponse({"detail": "Authentication credentials were not provided."})
            response.status_code = 401
            response["WWW-Authenticate"] = 'Basic realm="api"'
            return response
        request.user = user
        return await view(request, *args, **kwargs)

    return checked


async def _basic_user(request: HttpRequest) -> Any:
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        username, _, password = base64.b64decode(credentials).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return await aauthenticate(request, username=username, password=password)


def payment_input(request: HttpRequest) -> dict[str, Any] | HttpResponse:
    """The payment the body asks for, validated as the DRF view validates it; or the 400."""
    try:
        data = json.loads(request.body)
    except ValueError:
        return JsonResponse({"detail": "The body must be JSON."}, status=400)
    if not isinstance(data, dict):
        return JsonResponse({"detail": "The body must be a JSON object."}, status=400)
    serializer = PaymentSerializer(data=data, context={"request": request})
    if not serializer.is_valid():
        return JsonResponse(serializer.errors, status=400)
    return dict(serializer.validated_data)


def created(request: HttpRequest, payment: Payment) -> JsonResponse:
    """The 201 that tells of ``payment``, as the DRF view's."""
    body = PaymentSerializer(payment, context={"request": request}).data
    # str(): the serializer's URL is DRF's Hyperlink, which WSGI servers refuse as a header.
    return JsonResponse(body, status=201, headers={"Location": str(body["url"])})


async def record_payment(request: HttpRequest, data: dict[str, Any], reference: str) -> Payment:
    """Save the payment and its ledger entry, in the transaction that holds the key."""
    payment = await Payment.objects.acreate(
        owner=request.user, provider_reference=reference, **data
    )
    await LedgerEntry.objects.acreate(
        payment=payment,
        kind=LedgerEntry.Kind.CHARGE,
        amount=payment.amount,
        currency=payment.currency,
    )
    return payment


@csrf_exempt
@authenticated
@idempotent
async def create_payment(request: HttpRequest) -> HttpResponse:
    """Take a payment: send an ``Idempotency-Key``, and send it again with each retry."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    data = payment_input(request)
    if isinstance(data, HttpResponse):
        return data  # a 400: not kept, so the corrected retry with the same key runs
    reference = await provider.aauthorize(data["amount"], data["currency"])
    return created(request, await record_payment(request, data, reference))


def _provider_key(key: ScopedKey | None) -> str:
    # None only with the library switched off (ENABLED): then nothing protects a retry.
    return key.downstream_key if key is not None else f"unprotected-{uuid.uuid4()}"


def find_charge(request: HttpRequest, *, key: ScopedKey, attempt: int) -> HttpResponse | None:
    """Before a charge whose earlier request did not finish runs again: did the provider take
    the money? If so, record the payment (once: its provider reference is unique) and answer."""
    reference = provider.find_charge(key.downstream_key)
    if reference is None:
        return None  # the provider never charged: run the view again
    payment = Payment.objects.filter(provider_reference=reference).first()
    if payment is None:
        data = payment_input(request)
        if isinstance(data, HttpResponse):
            return data
        payment = Payment.objects.create(owner=request.user, provider_reference=reference, **data)
        LedgerEntry.objects.create(
            payment=payment,
            kind=LedgerEntry.Kind.CHARGE,
            amount=payment.amount,
            currency=payment.currency,
        )
    return created(request, payment)


@csrf_exempt
@authenticated
@idempotent(mode="lease", recover=find_charge)
async def charge_card(request: HttpRequest) -> HttpResponse:
    """Charge a card at the provider, in lease mode: the key commits before the provider is
    called, and its lease is renewed for as long as the view awaits the provider."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    data = payment_input(request)
    if isinstance(data, HttpResponse):
        return data
    reference = await provider.acharge(
        data["amount"],
        data["currency"],
        idempotency_key=_provider_key(key_of(request)),
        description=data.get("description", ""),
    )
    return created(request, await record_payment(request, data, reference))
