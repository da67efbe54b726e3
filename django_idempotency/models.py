from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from django.db import OperationalError, connections, models, router, transaction
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

if TYPE_CHECKING:
    from datetime import datetime

    from django.db.backends.base.base import BaseDatabaseWrapper

logger = logging.getLogger("django_idempotency")


@dataclass(frozen=True)
class PurgeResult:
    """What one purge run did."""

    deleted: int
    batches: int
    seconds: float
    longest_batch: float  # seconds: the longest that one batch's transaction took
    complete: bool  # False when the run stopped at its time limit


class IdempotencyKeyManager(models.Manager["IdempotencyKey"]):
    def purge_expired(
        self,
        *,
        now: datetime | None = None,
        batch_size: int = 10_000,
        pause: float = 0.0,
        max_seconds: float | None = None,
    ) -> PurgeResult:
        """Delete keys past their expiry, ``batch_size`` ids at a time, each batch committed alone.

        Walks the primary key from the oldest row to the newest that existed at the start, so
        each batch is a short range delete that holds its locks only until it commits; call it
        outside a transaction. ``pause`` seconds between batches throttle the run;
        ``max_seconds`` bounds it (the next run carries on). Safe in several processes at once.
        """
        now = now or timezone.now()
        using = router.db_for_write(self.model)
        connection = connections[using]
        bounds = self.using(using).aggregate(low=models.Min("pk"), high=models.Max("pk"))
        started = time.monotonic()
        deleted = batches = 0
        longest_batch = 0.0
        complete = True
        if bounds["low"] is not None:
            prepared_now = self.model._meta.get_field("expires_at").get_db_prep_value(
                now, connection
            )
            for low in range(bounds["low"], bounds["high"] + 1, batch_size):
                if max_seconds is not None and time.monotonic() - started >= max_seconds:
                    complete = False
                    break
                batch_started = time.monotonic()
                deleted += _delete_batch(connection, [low, low + batch_size, prepared_now])
                longest_batch = max(longest_batch, time.monotonic() - batch_started)
                batches += 1
                if pause:
                    time.sleep(pause)
        result = PurgeResult(deleted, batches, time.monotonic() - started, longest_batch, complete)
        logger.info(
            "purged %d expired idempotency keys in %d batches (%.3f s)%s",
            result.deleted,
            result.batches,
            result.seconds,
            "" if complete else "; stopped at the time limit",
            extra={"idempotency_purged": result.deleted, "idempotency_batches": result.batches},
        )
        return result

    def sweep_expired_leases(self, *, now: datetime | None = None, batch_size: int = 1_000) -> int:
        """Mark keys whose lease ran out as failed, in batches; return how many.

        A request that died (a killed worker) leaves its key in progress until its lease runs
        out; then the next request with the key takes it over anyway. Sweeping does it ahead
        of time, and fences the dead request: it raises the lease version, so a worker that
        was only slow can no longer store its result. Safe in several processes at once: a
        lease is swept once.
        """
        now = now or timezone.now()
        connection = connections[router.db_for_write(self.model)]
        statement = _sweep_statement(connection)
        prepared_now = self.model._meta.get_field("locked_until").get_db_prep_value(now, connection)
        swept = 0
        while True:
            with connection.cursor() as cursor:
                cursor.execute(statement, [prepared_now, batch_size])
                count: int = cursor.rowcount
            swept += count
            if count < batch_size:
                break
        logger.info(
            "swept %d expired idempotency leases", swept, extra={"idempotency_swept": swept}
        )
        return swept


def _quoted_column(connection: BaseDatabaseWrapper, name: str) -> str:
    field = cast("models.Field[Any, Any]", IdempotencyKey._meta.get_field(name))
    return connection.ops.quote_name(field.column)


def _sweep_statement(connection: BaseDatabaseWrapper) -> str:
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)

    def c(name: str) -> str:
        return _quoted_column(connection, name)

    # Only leased, unfinished rows carry locked_until: the partial lease index finds them.
    pick = f"SELECT {c('id')} FROM {table} WHERE {c('locked_until')} <= %s "  # noqa: S608
    pick += f"ORDER BY {c('locked_until')} LIMIT %s"
    if connection.vendor == "postgresql":
        pick += " FOR UPDATE SKIP LOCKED"  # another sweeper's batch is its own
    return (
        f"UPDATE {table} SET {c('state')} = 'failed', {c('locked_until')} = NULL, "  # noqa: S608
        f"{c('lease_version')} = {c('lease_version')} + 1 WHERE {c('id')} IN ({pick})"
    )


# How long a purge batch waits for a row that a request holds (taking that expired key over)
# before it leaves the locked rows of that batch for the next run.
PURGE_LOCK_TIMEOUT = "100ms"


def _delete_batch(connection: BaseDatabaseWrapper, params: list[Any]) -> int:
    """Delete one range's expired rows in a transaction of its own; return how many."""
    table = connection.ops.quote_name(IdempotencyKey._meta.db_table)
    pk, expires = _quoted_column(connection, "id"), _quoted_column(connection, "expires_at")
    # Our own DELETE, not QuerySet.delete(): Django's collector would load every row into
    # Python as soon as a project connects a post_delete receiver to this model.
    where = f"{pk} >= %s AND {pk} < %s AND {expires} <= %s"
    delete = f"DELETE FROM {table} WHERE {where}"  # noqa: S608
    if connection.vendor != "postgresql":
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(delete, params)
            return int(cursor.rowcount)
    # A plain range delete is the fastest. A row it finds locked belongs to a request taking
    # that key over, which may hold it for the whole view: wait a moment (the CTE bounds the
    # wait before any row is locked), then skip the locked rows of this range instead, so
    # that no batch holds its locks for long.
    bounded = (
        "WITH bounded AS (SELECT set_config('lock_timeout', %s, true)) "  # noqa: S608
        f"DELETE FROM {table} WHERE {where} AND EXISTS (SELECT FROM bounded)"
    )
    try:
        with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
            cursor.execute(bounded, [PURGE_LOCK_TIMEOUT, *params])
            return int(cursor.rowcount)
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) != "55P03":  # lock_not_available
            raise
    skip_locked = (
        f"DELETE FROM {table} WHERE {pk} IN (SELECT {pk} FROM {table} "  # noqa: S608
        f"WHERE {where} FOR UPDATE SKIP LOCKED)"
    )
    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        cursor.execute(skip_locked, params)
        return int(cursor.rowcount)


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
    locked_until = models.DateTimeField(
        _("locked until"),
        null=True,
        blank=True,
        help_text=_("Lease mode: until when the request running the key owns it."),
    )
    attempts = models.PositiveIntegerField(
        _("attempts"),
        default=1,
        help_text=_("Requests that started running this key; above 1 after an unfinished one."),
    )
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

    objects = IdempotencyKeyManager()

    class Meta:
        verbose_name = _("idempotency key")
        verbose_name_plural = _("idempotency keys")
        constraints = [
            # The only arbiter of races between duplicates: see store.py. The key leads, so the
            # admin's search by key uses this index too.
            models.UniqueConstraint(fields=["key", "scope"], name="idempotency_scope_key_uniq"),
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
