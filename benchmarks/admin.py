#!/usr/bin/env python
"""The admin's key pages at 1,000,000 keys on PostgreSQL: how long each takes to render.

Fills the key table (a tenth of the keys expired, a few stuck leases, the keys of 1,000 users),
logs in a superuser and times the changelist, each filter, each kind of search (the exact key,
its first eight characters, a username, a route) and a key's page with Django's test client: the
whole request, queries and template included. Prints the median of several loads as a Markdown
table.

Usage: python benchmarks/admin.py [--keys N] [--loads N] [--database NAME]
(PGHOST/PGPORT/PGUSER as usual)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in {None, ""}:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import drop_database, plural, recreate_database, setup_django, table

DATABASE = "idempotency_bench_admin"

FILL_SQL = (
    "INSERT INTO django_idempotency_idempotencykey (scope, key, method, route, fingerprint, "
    "state, lease_version, attempts, response_status, response_headers, response_body, "
    "created_at, completed_at, expires_at, replay_count, locked_until) "
    "SELECT 'auth.user:' || (n %% 1000 + 1) || ' POST payments/', md5(n::text), 'POST', "
    "'payments/', "
    "md5(n::text) || md5(n::text), 'succeeded', 1, 1, 201, "
    "'[[\"Content-Type\", \"application/json\"]]', convert_to('{\"id\": ' || n || '}', 'UTF8'), "
    "now() - (n %% 86400) * interval '1 second', now(), "
    "CASE WHEN n %% 10 = 0 THEN now() - interval '1 hour' ELSE now() + interval '1 day' END, "
    "0, CASE WHEN n %% 100000 = 1 THEN now() - interval '1 minute' END "
    "FROM generate_series(1, %s) AS n"
)
# The 1,000 users whose keys they are: customer1 has ids 1, 1001, 2001…
USERS_SQL = (
    "INSERT INTO auth_user (id, username, password, is_superuser, first_name, last_name, email, "
    "is_staff, is_active, date_joined) "
    "SELECT n, 'customer' || n, '!', false, '', '', '', false, true, now() "
    "FROM generate_series(1, 1000) AS n; "
    "SELECT setval(pg_get_serial_sequence('auth_user', 'id'), 1000)"
)

# The pages, named as docs/benchmarks.md names them, and their query strings.
PAGES = {
    "the key list": "",
    "filter: expired": "?expires=expired",
    "filter: expires within an hour": "?expires=hour",
    "filter: expires today": "?expires=today",
    "filter: stuck lease": "?lease=expired",
    "filter: state": "?state__exact=succeeded",
    "filter: method": "?method=POST",
    "page 100 of the list": "?p=99",
    "search: the exact key": "?q={key}",
    "search: the key's first 8 characters": "?q={prefix}",
    "search: a username (1,000 keys)": "?q=customer500",
    "search: a username with no keys": "?q=root",
    "search: a route": "?q=route:payments/",
}

# The searches that must find the key they are given: each load is checked.
FINDS_THE_KEY = {"search: the exact key", "search: the key's first 8 characters"}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--database", default=DATABASE, help="created, then dropped")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """The median milliseconds of each page over ``args.loads`` loads, after one to warm up."""
    recreate_database(args.database)
    try:
        setup_django(args.database)
        return _measure(args)
    finally:
        drop_database(args.database)


def _measure(args: argparse.Namespace) -> dict[str, float]:
    from django.contrib.auth.models import User  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415
    from django.db import connection  # noqa: PLC0415
    from django.test import Client  # noqa: PLC0415

    from django_idempotency.models import IdempotencyKey  # noqa: PLC0415

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute(FILL_SQL, [args.keys])
        cursor.execute(USERS_SQL)
        cursor.execute("VACUUM ANALYZE django_idempotency_idempotencykey")
        cursor.execute("VACUUM ANALYZE auth_user")
    User.objects.create_superuser("root")  # logged in below, without a password
    client = Client()
    client.force_login(User.objects.get(username="root"))
    key = IdempotencyKey.objects.order_by("pk")[args.keys // 2]
    changelist = "/admin/django_idempotency/idempotencykey/"
    pages = {
        name: changelist + query.format(key=key.key, prefix=key.key[:8])
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
        if name in FINDS_THE_KEY and key.key.encode() not in response.content:
            raise SystemExit(f"{name}: the key is not on the page")
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
