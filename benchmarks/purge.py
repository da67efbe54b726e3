#!/usr/bin/env python
"""Purge throughput on PostgreSQL: purge_expired() against one unbatched DELETE of the same rows.

Prints a Markdown table. Usage: python benchmarks/purge.py [--rows N] [--batch-size N]
(PGHOST/PGPORT/PGUSER as usual)
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import drop_database, ratio, recreate_database, setup_django, table

DATABASE = "idempotency_bench_purge"

# N expired keys, spread over 1,000 principals.
FILL_SQL = (
    "INSERT INTO django_idempotency_idempotencykey (scope, key, method, route, fingerprint, "
    "state, lease_version, attempts, created_at, expires_at, replay_count) "
    "SELECT 'expired:' || (n %% 1000) || ' POST payments/', md5(n::text), 'POST', 'payments/', "
    "md5(n::text) || md5(n::text), 'succeeded', 1, 1, now() - interval '2 days', "
    "now() - interval '1 day', 0 FROM generate_series(1, %s) AS n"
)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=10_000)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Purge ``args.rows`` expired keys in batches, then delete as many with one statement."""
    recreate_database(DATABASE)
    try:
        setup_django(DATABASE)
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
            cursor.execute(
                "DELETE FROM django_idempotency_idempotencykey WHERE expires_at <= now()"
            )
            unbatched_rows = cursor.rowcount
        unbatched = time.monotonic() - started
        connection.close()
    finally:
        drop_database(DATABASE)
    return {
        "batched_rows": result.deleted,
        "batched_seconds": result.seconds,
        "longest_batch": result.longest_batch,
        "unbatched_rows": unbatched_rows,
        "unbatched_seconds": unbatched,
        "memory_growth_mib": memory_growth / 1024,  # ru_maxrss is in KiB on Linux
    }


def report(result: dict[str, float], args: argparse.Namespace) -> str:
    batched_rate = result["batched_rows"] / result["batched_seconds"]
    unbatched_rate = result["unbatched_rows"] / result["unbatched_seconds"]
    rows = [
        [
            "`purge_expired()`",
            f"{batched_rate:,.0f}",
            ratio(batched_rate / unbatched_rate),
            f"**{result['longest_batch'] * 1000:,.0f} ms**",
        ],
        [
            "one unbatched `DELETE`",
            f"{unbatched_rate:,.0f}",
            ratio(1.0, bold=False),
            f"{result['unbatched_seconds'] * 1000:,.0f} ms",
        ],
    ]
    return "\n\n".join(
        [
            f"{args.rows:,} expired keys, batches of {args.batch_size:,} ids: "
            f"`purge_expired()` deleted {result['batched_rows']:,.0f} rows in "
            f"{result['batched_seconds']:.2f} s, one `DELETE` {result['unbatched_rows']:,.0f} "
            f"in {result['unbatched_seconds']:.2f} s; the purging process's peak memory grew by "
            f"{result['memory_growth_mib']:.1f} MiB.",
            table(["", "rows/s", "vs one `DELETE`", "longest transaction"], rows),
        ]
    )


def main() -> None:
    args = parse_arguments()
    print(report(measure(args), args))


if __name__ == "__main__":
    main()
