#!/usr/bin/env python
"""The admin's key pages at 1,000,000 keys on PostgreSQL: how long each takes to render.

Fills the key table (a tenth of the keys expired, a few stuck leases), logs in a superuser and
times the changelist, each filter, the search and a key's page with Django's test client: the
whole request, queries and template included. Prints the median of several loads as a Markdown
table.

Usage: python benchmarks/admin.py [--keys N] [--loads N]   (PGHOST/PGPORT/PGUSER as usual)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlencode

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import drop_database, plural, recreate_database, setup_django, table

DATABASE = "idempotency_bench_admin"

FILL_SQL = (
    "INSERT INTO django_idempotency_idempotencykey (scope, key, method, route, fingerprint, "
    "state, lease_version, attempts, response_status, response_headers, response_body, "
    "created_at, completed_at, expires_at, replay_count, locked_until) "
    "SELECT 'auth.user:' || (n %% 1000) || ' POST payments/', md5(n::text), 'POST', 'payments/', "
    "md5(n::text) || md5(n::text), 'succeeded', 1, 1, 201, "
    "'[[\"Content-Type\", \"application/json\"]]', convert_to('{\"id\": ' || n || '}', 'UTF8'), "
    "now() - (n %% 86400) * interval '1 second', now(), "
    "CASE WHEN n %% 10 = 0 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END, "
    "0, CASE WHEN n %% 100000 = 1 THEN now() - interval '1 minute' END "
    "FROM generate_series(1, %s) AS n"
)

# The pages, named as docs/benchmarks.md names them, and their query strings.
PAGES = {
    "the key list": "",
    "filter: expired": "?expired=yes",
    "filter: stuck lease": "?lease=expired",
    "filter: state": "?state__exact=succeeded",
    "filter: method": "?method=POST",
    "filter: expiry date (past 7 days)": "?{past_week}",
    "page 100 of the list": "?p=99",
    "search by key": "?q={key}",
}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=5)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """The median milliseconds of each page over ``args.loads`` loads, after one to warm up."""
    recreate_database(DATABASE)
    try:
        setup_django(DATABASE)
        return _measure(args)
    finally:
        drop_database(DATABASE)


def _measure(args: argparse.Namespace) -> dict[str, float]:
    from django.contrib.auth.models import User  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415
    from django.db import connection  # noqa: PLC0415
    from django.test import Client  # noqa: PLC0415
    from django.utils import timezone  # noqa: PLC0415

    from django_idempotency.models import IdempotencyKey  # noqa: PLC0415

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, [args.keys])
        cursor.execute("VACUUM ANALYZE django_idempotency_idempotencykey")
    User.objects.create_superuser("root")  # logged in below, without a password
    client = Client()
    client.force_login(User.objects.get(username="root"))
    key = IdempotencyKey.objects.order_by("pk")[args.keys // 2]
    changelist = "/admin/django_idempotency/idempotencykey/"
    # The "Past 7 days" link of the expiry date filter, as Django builds it.
    today = timezone.localtime().replace(hour=0, minute=0, second=0, microsecond=0)
    past_week = urlencode(
        {
            "expires_at__gte": str(today - timedelta(days=7)),
            "expires_at__lt": str(today + timedelta(days=1)),
        }
    )
    pages = {
        name: changelist + query.format(key=key.key, past_week=past_week)
        for name, query in PAGES.items()
    }
    pages["a key's page"] = f"{changelist}{key.pk}/change/"

    medians = {}
    for name, url in pages.items():
        timings = []
        for _ in range(args.loads + 1):  # the first load warms up
            started = time.perf_counter()
            response = client.get(url)
            timings.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"{name}: {response.status_code}")
        medians[name] = statistics.median(timings[1:])
    connection.close()
    return medians


def report(medians: dict[str, float], args: argparse.Namespace) -> str:
    return "\n\n".join(
        [
            f"{args.keys:,} keys on PostgreSQL, a tenth of them expired; whole requests through "
            f"Django's test client (queries and templates included), median of "
            f"{plural(args.loads, 'load')}:",
            table(["page", "ms"], [[name, f"{ms:,.1f}"] for name, ms in medians.items()]),
        ]
    )


def main() -> None:
    args = parse_arguments()
    print(report(measure(args), args))


if __name__ == "__main__":
    main()
