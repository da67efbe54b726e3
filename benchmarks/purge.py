#!/usr/bin/env python
"""Purge throughput on PostgreSQL: purge_expired() against one unbatched DELETE of the same rows.

Usage: python benchmarks/purge.py [--rows N] [--batch-size N]   (PGHOST/PGPORT/PGUSER as usual)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "idempotency_bench_purge"

# N expired keys, spread over 1,000 principals.
FILL_SQL = (
    "INSERT INTO django_idempotency_idempotencykey (scope, key, method, route, fingerprint, "
    "state, lease_version, attempts, created_at, expires_at, replay_count) "
    "SELECT 'expired:' || (n %% 1000) || ' POST payments/', md5(n::text), 'POST', 'payments/', "
    "md5(n::text) || md5(n::text), 'succeeded', 1, 1, now() - interval '2 days', "
    "now() - interval '1 day', 0 FROM generate_series(1, %s) AS n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=10_000)
    args = parser.parse_args()

    import psycopg  # noqa: PLC0415

    server = {
        "host": os.environ.get("PGHOST", "127.0.0.1"),
        "port": os.environ.get("PGPORT", "5432"),
        "user": os.environ.get("PGUSER", "postgres"),
    }
    with psycopg.connect(**server, dbname="postgres", autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DATABASE}")

    sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["TEST_DATABASE"] = "postgresql"
    import django  # noqa: PLC0415
    from django.conf import settings  # noqa: PLC0415

    settings.DATABASES["default"]["NAME"] = DATABASE
    django.setup()
    from django.core.management import call_command  # noqa: PLC0415
    from django.db import connection  # noqa: PLC0415

    from django_idempotency.models import IdempotencyKey  # noqa: PLC0415

    call_command("migrate", "django_idempotency", verbosity=0)

    def fill() -> None:
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE django_idempotency_idempotencykey")
            cursor.execute(FILL_SQL, [args.rows])
            cursor.execute("VACUUM ANALYZE django_idempotency_idempotencykey")

    fill()
    memory_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = IdempotencyKey.objects.purge_expired(batch_size=args.batch_size)
    memory_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - memory_before
    fill()
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_idempotency_idempotencykey WHERE expires_at <= now()")
        unbatched_rows = cursor.rowcount
    unbatched = time.monotonic() - started

    batched_rate = result.deleted / result.seconds
    unbatched_rate = unbatched_rows / unbatched
    print(f"{args.rows} expired keys, batches of {args.batch_size} ids\n")
    print(f"{'':<22} {'rows':>9} {'seconds':>8} {'rows/s':>9} {'longest transaction':>20}")
    print(
        f"{'purge_expired()':<22} {result.deleted:>9} {result.seconds:>8.2f} "
        f"{batched_rate:>9.0f} {result.longest_batch * 1000:>17.0f} ms"
    )
    print(
        f"{'one unbatched DELETE':<22} {unbatched_rows:>9} {unbatched:>8.2f} "
        f"{unbatched_rate:>9.0f} {unbatched * 1000:>17.0f} ms"
    )
    print(f"\nbatched / unbatched throughput: {batched_rate / unbatched_rate:.2f}")
    print(f"peak memory growth of the purging process: {memory_growth / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
