from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(url="/api/payments/", permanent=False)),
    path("admin/", admin.site.urls),
    path("api/", include("payments.urls")),
    # Log in and out of DRF's browsable API.
    path("api-auth/", include("rest_framework.urls")),
]
