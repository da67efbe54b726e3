from __future__ import annotations

from django.urls import path

from payments import views

app_name = "payments"

urlpatterns = [
    path("payments/", views.PaymentList.as_view(), name="payment-list"),
    path("payments/<int:pk>/", views.PaymentDetail.as_view(), name="payment-detail"),
    path("refunds/", views.RefundList.as_view(), name="refund-list"),
    path("charges/", views.ChargeCard.as_view(), name="charge"),
    path("refunds/<int:pk>/", views.RefundDetail.as_view(), name="refund-detail"),
]
