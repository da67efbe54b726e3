"""Idempotency-Key support for Django and Django REST framework."""

from __future__ import annotations

__version__ = "1.0.0"
