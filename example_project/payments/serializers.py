from __future__ import annotations

from typing import Any

from rest_framework import serializers

from payments.models import Payment, Refund
from payments.validation import metadata_problem


class PaymentSerializer(serializers.ModelSerializer):
    # CreateModelMixin turns the "url" field into the 201's Location header.
    url = serializers.HyperlinkedIdentityField(view_name="payments:payment-detail")
    amount = serializers.IntegerField(min_value=1, max_value=99_999_999)
    currency = serializers.RegexField(r"^[A-Za-z]{3}$", max_length=3)

    class Meta:
        model = Payment
        fields = [
            "id",
            "url",
            "amount",
            "currency",
            "description",
            "metadata",
            "version",
            "amount_refunded",
            "provider_reference",
            "created_at",
        ]
        read_only_fields = ["version", "amount_refunded", "provider_reference", "created_at"]

    def validate_currency(self, value: str) -> str:
        return value.lower()

    def validate_metadata(self, value: Any) -> dict[str, Any]:
        # A form field "metadata=null" parses as JSON null, which the null check never sees.
        if not isinstance(value, dict):
            msg = "Must be a JSON object."
            raise serializers.ValidationError(msg)
        if (problem := metadata_problem(value)) is not None:
            raise serializers.ValidationError(problem)
        return value


class PaymentUpdateSerializer(PaymentSerializer):
    """A payment's description and metadata can change; the money cannot."""

    amount = serializers.IntegerField(read_only=True)
    currency = serializers.CharField(read_only=True)


class RefundSerializer(serializers.ModelSerializer):
    url = serializers.HyperlinkedIdentityField(view_name="payments:refund-detail")
    amount = serializers.IntegerField(
        min_value=1, required=False, help_text="Defaults to what is left to refund."
    )

    class Meta:
        model = Refund
        fields = ["id", "url", "payment", "amount", "reason", "created_at"]
        read_only_fields = ["created_at"]

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        # Someone else's payment does not exist, as far as this user can tell.
        user = self.context["request"].user
        payments = (
            Payment.objects.filter(owner=user) if user.is_authenticated else Payment.objects.none()
        )
        fields["payment"].queryset = payments
        return fields
