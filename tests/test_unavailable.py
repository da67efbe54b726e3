"""One answer to a database that is unavailable, whichever adapter serves the view."""

from __future__ import annotations

import json

import pytest
from django.db import OperationalError, ProgrammingError
from django.http import JsonResponse
from django.test import Client, override_settings
from django.urls import path
from rest_framework.authentication import BaseAuthentication
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency import problems
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.inbox import views as inbox_views
from tests.inbox import deliver, refund_event
from tests.testapp import webhooks


def failover(*args, **kwargs):
    raise OperationalError("the server closed the connection")


class FailingAuthentication(BaseAuthentication):
    def authenticate(self, request):
        failover()


class DRFView(IdempotentMixin, APIView):
    authentication_classes = [FailingAuthentication]
    permission_classes = []

    def post(self, request):
        return Response({}, status=201)


@idempotent(required=False)
def plain_view(request):
    failover()
    return JsonResponse({}, status=201)


def _ninja_patterns():
    from ninja import NinjaAPI  # noqa: PLC0415 - an optional extra
    from ninja.security import HttpBearer  # noqa: PLC0415

    from django_idempotency.ninja import idempotent as ninja_idempotent  # noqa: PLC0415

    class FailingBearer(HttpBearer):
        def authenticate(self, request, token):
            failover()

    api = NinjaAPI(urls_namespace="unavailable-ninja")

    @api.post("/charges/", auth=FailingBearer())
    @ninja_idempotent()
    def charge(request):
        return {"charged": True}

    return [path("ninja/", api.urls)]


class URLConf:
    urlpatterns = [
        path("drf/", DRFView.as_view()),
        path("plain/", plain_view),
        path("webhooks/tests/", webhooks.TestWebhook.as_view()),
        *_ninja_patterns(),
    ]


TITLE = problems.UNAVAILABLE.title


def post(url, **headers):
    return Client().post(url, b"{}", content_type="application/json", headers=headers)


ANSWERS = {
    "a DRF view": lambda: post("/drf/", **{"Idempotency-Key": "k"}),
    "a plain view": lambda: post("/plain/"),
    "a Ninja operation": lambda: post("/ninja/charges/", Authorization="Bearer t"),
    "the inbox's receiver": lambda: deliver(refund_event()),
}


@pytest.fixture
def _inbox_down(monkeypatch):
    monkeypatch.setattr(inbox_views, "receive", failover)


# The answer marks every open transaction for rollback: the test's own too.
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_inbox_down")
@override_settings(ROOT_URLCONF=URLConf)
@pytest.mark.parametrize("sender", ANSWERS)
def test_each_adapter_and_the_inbox_answer_the_one_problem(sender, caplog):
    response = ANSWERS[sender]()

    assert response.status_code == 503
    assert response["Content-Type"] == "application/problem+json"
    assert response["Retry-After"] == "1"
    assert json.loads(response.content) == {
        "type": problems.TYPE_PREFIX + "idempotency.unavailable",
        "title": TITLE,
        "status": 503,
        "detail": "The database could not complete the request. Retry it.",
        "code": "idempotency.unavailable",
    }
    logged = [r for r in caplog.records if r.getMessage() == "database unavailable"]
    assert len(logged) == 1  # logged once, with its error
    assert logged[0].exc_info[0] is OperationalError


@pytest.mark.django_db
@override_settings(ROOT_URLCONF=URLConf)
def test_another_database_error_is_a_fault_left_to_django(monkeypatch):
    def broken(*args, **kwargs):
        raise ProgrammingError("no such table: django_idempotency_inboxevent")

    monkeypatch.setattr(inbox_views, "receive", broken)
    with pytest.raises(ProgrammingError):
        deliver(refund_event())
