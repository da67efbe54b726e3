from __future__ import annotations

from django.contrib import admin
from django.urls import include, path
from rest_framework.routers import SimpleRouter

from tests.testapp import conditional, views, webhooks

router = SimpleRouter()
router.register("viewset-payments", views.PaymentViewSet, basename="viewset-payment")

urlpatterns = [
    path("admin/", admin.site.urls),
    path("payments/", views.PaymentView.as_view()),
    path("payments/other-route/", views.PaymentView.as_view()),
    path("not-idempotent/", views.NotIdempotentPaymentView.as_view()),
    path("tenant/<str:tenant>/payments/", views.PaymentView.as_view()),
    path("throttled/", views.ThrottledPaymentView.as_view()),
    path("optional/", views.OptionalKeyPaymentView.as_view()),
    path("put/", views.PutPaymentView.as_view()),
    path("headers/", views.TenantPaymentView.as_view()),
    path("anonymous/", views.AnonymousPaymentView.as_view()),
    path("plain/", views.plain_payment),
    path("async/", views.async_payment),
    path("async/read-first/", views.reads_first(views.async_payment)),
    path("async/read-first/bare/", views.reads_first(views.bare_async_payment)),
    path("plain-optional/", views.plain_optional),
    path("upload/", views.upload),
    path("streaming/", views.streaming),
    path("empty/", views.empty),
    path("lock-wait/", views.lock_wait),
    path("lease-lock-wait/", views.lease_lock_wait),
    path("class-based/", views.ClassBasedPayment.as_view()),
    path("template/", views.template_payment),
    path("per-tenant/", views.PerTenantPaymentView.as_view()),
    path("accounts/<str:account>/payments/", views.PerAccountPaymentView.as_view()),
    path("twice/", views.twice),
    path("lease/", views.LeasePaymentView.as_view()),
    path("text-note/", views.TextNoteView.as_view()),
    path("lease-recovering/", views.RecoveringLeasePaymentView.as_view()),
    path("api/", include(router.urls)),
    path("guard/", views.guard_echo),
    path("guard/async/", views.guard_echo_async),
    path("relay/", views.relay),
    path("documents/<int:pk>/", conditional.VersionedDocument.as_view()),
    path("documents/<int:pk>/by-content/", conditional.ContentDocument.as_view()),
    path("documents/<int:pk>/strict/", conditional.StrictDocument.as_view()),
    path("documents/<int:pk>/idempotent/", conditional.IdempotentDocument.as_view()),
    path("plain-documents/<int:pk>/", conditional.plain_versioned),
    path("plain-documents/<int:pk>/by-content/", conditional.plain_by_content),
    path("plain-documents/<int:pk>/idempotent/", conditional.plain_idempotent),
    path("webhooks/tests/", webhooks.TestWebhook.as_view()),
    path("webhooks/small/", webhooks.SmallWebhook.as_view()),
    path("webhooks/stripe/", webhooks.StripeWebhook.as_view()),
    path("webhooks/github/", webhooks.GitHubWebhook.as_view()),
    path("webhooks/outbox/", webhooks.OutboxWebhook.as_view()),
]
