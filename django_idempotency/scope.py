"""Who a key belongs to: the default scope function."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied

from django_idempotency.conf import idempotency_settings

__all__ = ["AnonymousRejected", "default_scope", "get_principal"]


class AnonymousRejected(PermissionDenied):
    """Raised by a scope function that will not accept an anonymous request."""


def get_principal(request: Any) -> str:
    """Name the authenticated principal of ``request``, or apply the anonymous policy."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        # The model names the principal too: two kinds of principal may share a pk.
        meta = getattr(user, "_meta", None)
        kind = meta.label_lower if meta is not None else type(user).__qualname__
        return f"{kind}:{user.pk}"
    if idempotency_settings.ANONYMOUS == "reject":
        raise AnonymousRejected
    return "anonymous"


def default_scope(request: Any, route: str) -> str:
    """Scope a key to the principal, the HTTP method and the route pattern."""
    return f"{get_principal(request)} {request.method} {route}"
