from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView

from payments.webhooks import PaymentEventsWebhook, ProviderWebhook

urlpatterns = [
    path("", RedirectView.as_view(url="/api/payments/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/", include("payments.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("webhooks/provider/", ProviderWebhook.as_view()),
    path("webhooks/payments/", PaymentEventsWebhook.as_view()),
    # Log in and out of DRF's browsable API.
    path("api-auth/", include("rest_framework.urls")),
]
