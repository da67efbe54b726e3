#!/usr/bin/env python
"""The admin's key pages at 1,000,000 keys on PostgreSQL: how long each takes to render.

Fills the key table (a tenth of the keys expired, a few stuck leases), logs in a superuser and
times the changelist, each filter, the search and a key's page with Django's test client: the
whole request, queries and template included. Prints the median of several loads.

Usage: python benchmarks/admin.py [--keys N] [--loads N]   (PGHOST/PGPORT/PGUSER as usual)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parent.parent
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

PAGES = {
    "changelist": "",
    "filter: expired": "?expired=yes",
    "filter: stuck lease": "?lease=expired",
    "filter: state": "?state__exact=succeeded",
    "filter: method": "?method=POST",
    "filter: expiry date": "?{past_week}",
    "page 100": "?p=99",
    "search by key": "?q={key}",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=5)
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
    os.environ["TEST_PG_NAME"] = DATABASE
    import django  # noqa: PLC0415

    django.setup()
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

    print(f"{args.keys:,} keys on PostgreSQL; median of {args.loads} loads\n")
    print(f"{'page':<20} {'ms':>8}")
    for name, url in pages.items():
        timings = []
        for _ in range(args.loads + 1):  # the first load warms up
            started = time.perf_counter()
            response = client.get(url)
            timings.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise SystemExit(f"{name}: {response.status_code}")
        print(f"{name:<20} {statistics.median(timings[1:]):>8.1f}", flush=True)


if __name__ == "__main__":
    main()
