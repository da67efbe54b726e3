"""Idempotency-Key support for Django and Django REST framework."""

from __future__ import annotations

__version__ = "0.1.0.dev0"
