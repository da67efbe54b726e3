"""The engine's public name: tests inject a clock or a store into an ``Engine`` of their own.

This module is the name's one public path. The engine lives in ``django_idempotency.core``,
with what it is built of, where the adapters reach it without climbing to this floor.
"""

from __future__ import annotations

from django_idempotency.core.engine import Engine

__all__ = ["Engine"]
