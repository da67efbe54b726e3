from __future__ import annotations

from django.urls import include, path
from rest_framework.routers import SimpleRouter

from benchmarks.minimal import views
from benchmarks.naive import bare_webhook

router = SimpleRouter()
router.register("bare/payments", views.BarePayments, "bare")
router.register("payments", views.Payments, "payments")
router.register("cached/payments", views.CachedPayments, "cached")
router.register("naive/payments", views.NaivePayments, "naive")
router.register("naive/cached/payments", views.NaiveCachedPayments, "naive-cached")

urlpatterns = [
    path("", include(router.urls)),
    path("bare/webhooks/", bare_webhook),
    path("naive/webhooks/", views.naive_inbox),
    path("webhooks/", views.ProviderWebhook.as_view()),
]
