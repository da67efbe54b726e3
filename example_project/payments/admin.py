from __future__ import annotations

from django.contrib import admin

from payments.models import LedgerEntry, Payment, Refund


class RefundInline(admin.TabularInline):
    model = Refund
    extra = 0
    fields = ["id", "amount", "reason", "created_at"]
    readonly_fields = fields


class LedgerEntryInline(admin.TabularInline):
    model = LedgerEntry
    extra = 0
    fields = ["id", "kind", "amount", "currency", "refund", "created_at"]
    readonly_fields = fields


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):
    list_display = ["id", "owner", "amount", "currency", "amount_refunded", "created_at"]
    list_filter = ["currency", "owner"]
    search_fields = ["description", "provider_reference"]
    readonly_fields = ["created_at"]
    inlines = [RefundInline, LedgerEntryInline]


@admin.register(Refund)
class RefundAdmin(admin.ModelAdmin):
    list_display = ["id", "payment", "amount", "reason", "created_at"]
    list_select_related = ["payment"]
    raw_id_fields = ["payment"]
    readonly_fields = ["created_at"]


@admin.register(LedgerEntry)
class LedgerEntryAdmin(admin.ModelAdmin):
    list_display = ["id", "payment", "kind", "amount", "currency", "created_at"]
    list_filter = ["kind", "currency"]
    list_select_related = ["payment"]
    raw_id_fields = ["payment", "refund"]
    readonly_fields = ["created_at"]
