"""The engine's public name: tests inject a clock or a store into an ``Engine`` of their own.

The engine lives in ``django_idempotency.core``, with what it is built of.
"""

from __future__ import annotations

from django_idempotency.core.engine import Engine

__all__ = ["Engine"]
