"""What the benchmark scripts share: the PostgreSQL server, its databases, Django, Markdown."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent


def dsn(database: str) -> str:
    """Connection string for ``database`` on the server of PGHOST, PGPORT and PGUSER.

    By default 127.0.0.1:5432 as postgres, like the test settings.
    """
    from psycopg.conninfo import make_conninfo  # noqa: PLC0415 - only the benchmarks need it

    return make_conninfo(
        host=os.environ.get("PGHOST", "127.0.0.1"),
        port=os.environ.get("PGPORT", "5432"),
        user=os.environ.get("PGUSER", "postgres"),
        dbname=database,
    )


def _administer(*statements: str) -> None:
    import psycopg  # noqa: PLC0415

    with psycopg.connect(dsn("postgres"), autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def recreate_database(name: str) -> None:
    """Drop the database ``name`` if it exists, with its connections, and create it empty."""
    _administer(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)", f"CREATE DATABASE {name}")


def drop_database(name: str) -> None:
    """Drop the database ``name`` if it exists, closing its connections."""
    _administer(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def setup_django(database: str) -> None:
    """Set Django up in this process: the test settings, on PostgreSQL database ``database``."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["TEST_DATABASE"] = "postgresql"
    os.environ["TEST_PG_NAME"] = database
    import django  # noqa: PLC0415

    django.setup()


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table, in the style of docs/benchmarks.md."""

    def line(cells: Sequence[str]) -> str:
        return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])


def plural(number: int, noun: str) -> str:
    """``3 rounds``, ``1 round``."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def millis(value: float) -> str:
    """Milliseconds as the tables show them: ``12.3 ms``."""
    return f"{value:,.1f} ms"


def ratio(value: float, *, bold: bool = True) -> str:
    """A ratio as the tables show them, in bold where it is the figure that matters."""
    return f"**{value:.2f}**" if bold else f"{value:.2f}"
