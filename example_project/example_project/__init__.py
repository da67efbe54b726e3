"""The example project: a payments API that uses django-idempotency."""

from __future__ import annotations
