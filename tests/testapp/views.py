from __future__ import annotations

import asyncio
import json
import time
from functools import wraps

from django.db import connection
from django.http import HttpResponse, JsonResponse, StreamingHttpResponse
from django.template import engines
from django.template.response import TemplateResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.parsers import BaseParser
from rest_framework.permissions import AllowAny, BasePermission, IsAuthenticated
from rest_framework.response import Response
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView

from django_idempotency import guard
from django_idempotency.client import RetryPolicy, retrying_client
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotentMixin
from tests.testapp import provider
from tests.testapp.models import LedgerEntry, Payment


class PaymentSerializer(serializers.ModelSerializer):
    metadata = serializers.JSONField(required=False, write_only=True)

    class Meta:
        model = Payment
        fields = ["id", "amount", "currency", "metadata"]


def create_payment(request, data):
    """Write a payment and its ledger entry, then misbehave as the X-Hold/X-Fail headers ask."""
    payment = Payment.objects.create(
        owner=request.user if request.user.is_authenticated else None,
        amount=data["amount"],
        currency=data.get("currency", "EUR"),
        metadata=data.get("metadata", {}),
    )
    LedgerEntry.objects.create(payment=payment, amount=payment.amount)
    if hold := request.headers.get("X-Hold"):
        time.sleep(float(hold))
    if request.headers.get("X-Fail") == "validation":
        raise ValidationError({"amount": "rejected after the write"})
    if request.headers.get("X-Fail") == "exception":
        raise RuntimeError("boom after the write")
    if request.headers.get("X-Fail") == "disconnect":
        # The server ends this session, as a failover or a restart would.
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            else:
                cursor.execute(f"KILL {int(connection.connection.thread_id())}")
    return payment


class PaymentView(IdempotentMixin, APIView):
    def post(self, request, **kwargs):
        serializer = PaymentSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        payment = create_payment(request, serializer.validated_data)
        if forced := request.headers.get("X-Status"):
            return Response({"forced": forced}, status=int(forced))
        response = Response(PaymentSerializer(payment).data, status=status.HTTP_201_CREATED)
        response["Location"] = f"/payments/{payment.pk}/"
        response["ETag"] = f'"payment-{payment.pk}"'
        response.set_cookie("flavour", "chocolate")
        response["Set-Cookie"] = "session=first-response-only"  # a raw header, never replayed
        response["X-Request-Trace"] = "view-set"
        return response

    def get(self, request):
        return Response({"count": Payment.objects.count()})

    def delete(self, request):
        deleted, _ = Payment.objects.all().delete()
        return Response({"deleted": deleted})


class NotIdempotentPaymentView(APIView):
    """Writes a payment on every request, key or not: what assert_idempotent must catch."""

    def post(self, request):
        payment = create_payment(request, request.data)
        return Response({"id": payment.pk}, status=201)


class TwoPerMinute(UserRateThrottle):
    rate = "2/minute"


class ThrottledPaymentView(PaymentView):
    throttle_classes = [TwoPerMinute]


class OptionalKeyPaymentView(PaymentView):
    idempotency_required = False


class PutPaymentView(IdempotentMixin, APIView):
    idempotency_methods = ("POST", "PUT")

    def put(self, request):
        payment = create_payment(request, request.data)
        return Response({"id": payment.pk})


class TenantPaymentView(PaymentView):
    idempotency_fingerprint_headers = ("X-Tenant",)


class AnonymousPaymentView(PaymentView):
    permission_classes = [AllowAny]
    authentication_classes = []


class PaymentViewSet(IdempotentMixin, viewsets.ModelViewSet):
    serializer_class = PaymentSerializer
    queryset = Payment.objects.all()

    def perform_create(self, serializer):
        payment = serializer.save(owner=self.request.user)
        LedgerEntry.objects.create(payment=payment, amount=payment.amount)

    @action(detail=True, methods=["post"])
    def refund(self, request, pk=None):
        payment = self.get_object()
        if payment.amount == 0:
            raise ValidationError({"amount": "already refunded"})
        entry = LedgerEntry.objects.create(payment=payment, amount=-payment.amount)
        return Response({"refunded": payment.amount, "entry": entry.pk}, status=201)


@csrf_exempt
@idempotent
def plain_payment(request):
    if request.method == "GET":
        return JsonResponse({"count": Payment.objects.count()})
    data = json.loads(request.body)
    payment = create_payment(request, data)
    if forced := request.headers.get("X-Status"):
        return JsonResponse({"forced": forced}, status=int(forced))
    return JsonResponse({"id": payment.pk, "amount": payment.amount}, status=201)


@csrf_exempt
@idempotent(required=False, ttl=60)
def plain_optional(request):
    payment = create_payment(request, json.loads(request.body))
    return JsonResponse({"id": payment.pk}, status=201)


@csrf_exempt
@idempotent
def upload(request):
    upload = request.FILES["file"]
    size = sum(len(chunk) for chunk in upload.chunks())
    payment = Payment.objects.create(amount=size, currency="UPL")
    return JsonResponse(
        {"id": payment.pk, "size": size, "note": request.POST.get("note")}, status=201
    )


@csrf_exempt
@idempotent
def streaming(request):
    Payment.objects.create(amount=1)
    return StreamingHttpResponse((part for part in [b"chunk-1,", b"chunk-2"]), status=201)


@csrf_exempt
@idempotent
def empty(request):
    Payment.objects.create(amount=2)
    response = HttpResponse(status=204)
    del response["Content-Type"]
    return response


def lock_wait_bound():
    """How long this connection's statements wait for a row lock, as the database says it:
    PostgreSQL's lock_timeout, MariaDB's innodb_lock_wait_timeout; None on SQLite."""
    asked = {"postgresql": "SHOW lock_timeout", "mysql": "SELECT @@innodb_lock_wait_timeout"}
    if connection.vendor not in asked:
        return None
    with connection.cursor() as cursor:
        cursor.execute(asked[connection.vendor])
        return str(cursor.fetchone()[0])


def report_lock_wait(request):
    """Report the lock wait bound the view's statements run under; with ``X-Lock-Payment``,
    first lock that payment's row, waiting for whoever holds it."""
    if payment := request.headers.get("X-Lock-Payment"):
        Payment.objects.select_for_update().get(pk=payment)
    return JsonResponse({"lock_wait": lock_wait_bound()}, status=201)


lock_wait = csrf_exempt(idempotent(report_lock_wait))
lease_lock_wait = csrf_exempt(idempotent(mode="lease")(report_lock_wait))


@method_decorator(csrf_exempt, name="dispatch")
@method_decorator(idempotent(fingerprint_headers=["X-Tenant"]), name="dispatch")
class ClassBasedPayment(View):
    def post(self, request):
        payment = create_payment(request, json.loads(request.body))
        return JsonResponse({"id": payment.pk}, status=201)


def rendered_later(request):
    Payment.objects.create(amount=3)
    template = engines["django"].from_string("payment {{ n }}")
    return TemplateResponse(request, template, {"n": 3}, status=201)


template_payment = csrf_exempt(idempotent(rendered_later))


def tenant_scope(request, route):
    return f"tenant:{request.headers['X-Tenant']}"


class PerTenantPaymentView(PaymentView):
    idempotency_scope_function = tenant_scope


class PerAccountPaymentView(PaymentView):
    def get_idempotency_scope(self, request, route):
        return f"account:{self.kwargs['account']}"


class MisconfiguredPaymentView(PaymentView):
    idempotency_methods = "POST"


class UnimportableScopePaymentView(PaymentView):
    idempotency_scope_function = "tests.testapp.no_such_module.scope"


twice = csrf_exempt(idempotent(idempotent(plain_payment)))


class LeasePaymentView(IdempotentMixin, APIView):
    """An effect that leaves the database: a charge at a provider, then our record of it.

    ``X-Delay`` makes the provider slow before it charges, ``X-Hold`` the view slow after the
    charge and before recording it, ``X-Hold-Recorded`` slow after recording it.
    """

    idempotency_mode = "lease"
    idempotency_lease_timeout = 1

    def post(self, request):
        key = request.headers["Idempotency-Key"]
        if delay := request.headers.get("X-Delay"):
            time.sleep(float(delay))
        provider.charge(key, request.data["amount"])
        if hold := request.headers.get("X-Hold"):
            time.sleep(float(hold))
        if request.headers.get("X-Fail") == "exception":
            raise RuntimeError("boom after the effect")
        payment = Payment.objects.create(amount=request.data["amount"], reference=key)
        if hold := request.headers.get("X-Hold-Recorded"):
            time.sleep(float(hold))
        if forced := request.headers.get("X-Status"):
            return Response({"forced": forced}, status=int(forced))
        return Response({"id": payment.pk}, status=201)


class RecoveringLeasePaymentView(LeasePaymentView):
    recovered = []

    def recover_idempotent_request(self, request, *, key, attempt):
        self.recovered.append((key, attempt))
        charge = provider.find_charge(key)
        if charge is None:
            return None  # the provider never charged: run the view again
        payment = Payment.objects.filter(reference=key).first()
        payment = payment or Payment.objects.create(amount=charge.amount, reference=key)
        return Response({"id": payment.pk}, status=201)


class PlainTextParser(BaseParser):
    """Streams the body, as many parsers do, so the body cannot be read again afterwards."""

    media_type = "text/plain"

    def parse(self, stream, media_type=None, parser_context=None):
        return stream.read().decode()


class ReadsDataFirst(BasePermission):
    def has_permission(self, request, view):
        return request.data is not None


class TextNoteView(IdempotentMixin, APIView):
    parser_classes = [PlainTextParser]
    permission_classes = [IsAuthenticated, ReadsDataFirst]

    def post(self, request):
        Payment.objects.create(amount=len(request.data))
        return Response({"note": request.data}, status=201)


def guard_echo(request):
    """What the retry guard knows of this request's caller."""
    return JsonResponse(
        {"remaining": guard.remaining(), "retries_allowed": guard.retries_allowed()}
    )


async def guard_echo_async(request):
    return JsonResponse(
        {"remaining": guard.remaining(), "retries_allowed": guard.retries_allowed()}
    )


@csrf_exempt
def relay(request):
    """A service in the middle: call the service named by X-Downstream, retrying, and relay its
    status, as an API gateway or a backend-for-frontend does."""
    policy = RetryPolicy(max_attempts=3, base_delay=0.0, max_delay=0.0, budget=None)
    with retrying_client(policy) as http:
        response = http.get(request.headers["X-Downstream"])
    return JsonResponse({"downstream": response.status_code}, status=response.status_code)


def reads_first(view):
    """Query the database before ``view`` runs, as authentication does."""

    @wraps(view)
    async def read_first(request, *args, **kwargs):
        await Payment.objects.aexists()
        return await view(request, *args, **kwargs)

    return read_first


@csrf_exempt
async def bare_async_payment(request):
    """``async_payment`` without ``@idempotent``: its bare twin."""
    data = json.loads(request.body)
    payment = await Payment.objects.acreate(amount=data["amount"])
    await LedgerEntry.objects.acreate(payment=payment, amount=payment.amount)
    return JsonResponse({"id": payment.pk}, status=201)


@csrf_exempt
@idempotent
async def async_payment(request):
    """An async view: its writes must join the key's transaction, as a sync view's do."""
    data = json.loads(request.body)
    payment = await Payment.objects.acreate(amount=data["amount"])
    await LedgerEntry.objects.acreate(payment=payment, amount=payment.amount)
    if hold := request.headers.get("X-Hold"):
        await asyncio.sleep(float(hold))
    if request.headers.get("X-Fail") == "exception":
        raise RuntimeError("boom after the write")
    if forced := request.headers.get("X-Status"):
        return JsonResponse({"forced": forced}, status=int(forced))
    return JsonResponse({"id": payment.pk}, status=201)
