"""Payments and refunds, each made safe to retry with an Idempotency-Key."""

from __future__ import annotations
