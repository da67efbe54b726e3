from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from payments import async_views
from payments.ninja_api import api as ninja_api
from payments.webhooks import PaymentEventsWebhook, ProviderWebhook


def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus metrics: the library's counters and backlog gauges, among any others.

    For staff, or for a scraper that sends ``Authorization: Bearer <METRICS_TOKEN>``: route
    names, task names and backlogs are not for everyone.
    """
    token = settings.METRICS_TOKEN
    sent = request.headers.get("Authorization", "")
    if not (request.user.is_staff or (token and hmac.compare_digest(sent, f"Bearer {token}"))):
        return HttpResponse("Staff or the metrics token only.\n", status=403)
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)


urlpatterns = [
    path("", RedirectView.as_view(url="/api/payments/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/", include("payments.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The same payments through Django Ninja: POST /ninja/payments/, the schema at /ninja/docs.
    path("ninja/", ninja_api.urls),
    # Plain Django async views (ASGI: example_project.asgi): a payment, and a card charge in
    # lease mode. The async Ninja route is POST /ninja/async-payments/.
    path("async/payments/", async_views.create_payment, name="async-payments"),
    path("async/charges/", async_views.charge_card, name="async-charges"),
    path("metrics/", metrics),
    path("webhooks/provider/", ProviderWebhook.as_view()),
    path("webhooks/payments/", PaymentEventsWebhook.as_view()),
    # Log in and out of DRF's browsable API.
    path("api-auth/", include("rest_framework.urls")),
]
