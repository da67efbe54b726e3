"""The partial indexes become PartialIndex, which MariaDB builds without Django's warning.

Nothing changes in any database: the indexes 0001-0004 created are the ones PartialIndex
creates (partial on PostgreSQL and SQLite, on every row on MariaDB). Only the migration state
learns the new class.
"""

import django_idempotency.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_idempotency', '0005_mariadb_binary_keys'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(
                    model_name='idempotencykey',
                    name='idempotency_lease_idx',
                ),
                migrations.RemoveIndex(
                    model_name='inboxevent',
                    name='idempotency_inbox_due_idx',
                ),
                migrations.RemoveIndex(
                    model_name='inboxevent',
                    name='idempotency_inbox_done_idx',
                ),
                migrations.RemoveIndex(
                    model_name='inboxevent',
                    name='idempotency_inbox_dead_idx',
                ),
                migrations.RemoveIndex(
                    model_name='outboxmessage',
                    name='idempotency_outbox_due_idx',
                ),
                migrations.RemoveIndex(
                    model_name='outboxmessage',
                    name='idempotency_outbox_order_idx',
                ),
                migrations.RemoveIndex(
                    model_name='outboxmessage',
                    name='idempotency_outbox_done_idx',
                ),
                migrations.RemoveIndex(
                    model_name='outboxmessage',
                    name='idempotency_outbox_dead_idx',
                ),
                migrations.AddIndex(
                    model_name='idempotencykey',
                    index=django_idempotency.models.PartialIndex(fields=['locked_until'], name='idempotency_lease_idx', where=models.Q(('locked_until__isnull', False))),
                ),
                migrations.AddIndex(
                    model_name='inboxevent',
                    index=django_idempotency.models.PartialIndex(fields=['next_attempt_at'], name='idempotency_inbox_due_idx', where=models.Q(('next_attempt_at__isnull', False))),
                ),
                migrations.AddIndex(
                    model_name='inboxevent',
                    index=django_idempotency.models.PartialIndex(fields=['processed_at'], name='idempotency_inbox_done_idx', where=models.Q(('status', 'processed'))),
                ),
                migrations.AddIndex(
                    model_name='inboxevent',
                    index=django_idempotency.models.PartialIndex(fields=['received_at'], name='idempotency_inbox_dead_idx', where=models.Q(('status', 'dead'))),
                ),
                migrations.AddIndex(
                    model_name='outboxmessage',
                    index=django_idempotency.models.PartialIndex(fields=['next_attempt_at', 'id'], name='idempotency_outbox_due_idx', where=models.Q(('status', 'pending'))),
                ),
                migrations.AddIndex(
                    model_name='outboxmessage',
                    index=django_idempotency.models.PartialIndex(fields=['ordering_key', 'id'], name='idempotency_outbox_order_idx', where=models.Q(('status', 'pending'), models.Q(('ordering_key', ''), _negated=True))),
                ),
                migrations.AddIndex(
                    model_name='outboxmessage',
                    index=django_idempotency.models.PartialIndex(fields=['dispatched_at'], name='idempotency_outbox_done_idx', where=models.Q(('status', 'dispatched'))),
                ),
                migrations.AddIndex(
                    model_name='outboxmessage',
                    index=django_idempotency.models.PartialIndex(fields=['created_at'], name='idempotency_outbox_dead_idx', where=models.Q(('status', 'dead'))),
                ),
            ],
        ),
    ]
