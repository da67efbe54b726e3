"""Prometheus metrics: what a project that serves its own registry needs (``metrics`` extra).

This module is the name's one public path. The metrics themselves are registered when Django
starts; they live in ``django_idempotency.operations``, with the system checks and the tracing.
"""

from __future__ import annotations

from django_idempotency.operations.metrics import register_database_gauges

__all__ = ["register_database_gauges"]
