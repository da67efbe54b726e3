from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _


class IdempotencyKey(models.Model):
    """One idempotency key, its request fingerprint and, once completed, the stored response."""

    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", _("in progress")
        SUCCEEDED = "succeeded", _("succeeded")
        FAILED = "failed", _("failed")

    # A key table churns fast: a 32-bit key would run out.
    id = models.BigAutoField(primary_key=True)
    scope = models.CharField(
        _("scope"),
        max_length=512,
        help_text=_("Who sent the key and to which operation: principal, method and route."),
    )
    key = models.CharField(_("key"), max_length=255)
    method = models.CharField(_("method"), max_length=10)
    route = models.CharField(_("route"), max_length=512, help_text=_("The URL pattern."))
    fingerprint = models.CharField(
        _("fingerprint"), max_length=64, help_text=_("SHA-256 of the request.")
    )
    state = models.CharField(
        _("state"), max_length=16, choices=State.choices, default=State.IN_PROGRESS
    )
    lease_version = models.PositiveBigIntegerField(
        _("lease version"),
        default=1,
        help_text=_("Fencing token: raised each time another request takes the key over."),
    )
    locked_until = models.DateTimeField(_("locked until"), null=True, blank=True)
    response_status = models.PositiveSmallIntegerField(_("response status"), null=True, blank=True)
    response_headers = models.JSONField(
        _("response headers"),
        null=True,
        blank=True,
        help_text=_("The stored response's headers as [name, value] pairs, in order."),
    )
    response_body = models.BinaryField(_("response body"), null=True, blank=True)
    created_at = models.DateTimeField(_("created at"))
    completed_at = models.DateTimeField(_("completed at"), null=True, blank=True)
    expires_at = models.DateTimeField(_("expires at"))
    replay_count = models.PositiveIntegerField(_("replay count"), default=0)
    last_replayed_at = models.DateTimeField(_("last replayed at"), null=True, blank=True)

    class Meta:
        verbose_name = _("idempotency key")
        verbose_name_plural = _("idempotency keys")
        constraints = [
            # The only arbiter of races between duplicates: see engine.py.
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_scope_key_uniq"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="idempotency_expires_idx"),
            # Only leased rows carry locked_until. Keying the index on it rather than on the
            # state keeps completing a key (which changes the state) a HOT update.
            models.Index(
                fields=["locked_until"],
                name="idempotency_lease_idx",
                condition=models.Q(locked_until__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.method} {self.route})"
