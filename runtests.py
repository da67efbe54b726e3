#!/usr/bin/env python
"""Run the test suite once per database, then the example project's tests.

The database passes (see DATABASE_PASSES), by their names for --databases:

  pgbouncer   the races, the leases and the fault tests (but the broker's) through a PgBouncer
              of the pass's own, in transaction pooling mode (Debian's pgbouncer package)
  faults      the fault tests (tests/blackbox/): the example project served on PostgreSQL
  sqlite      every test, those that touch no database included (they run in this pass alone)
  postgresql  every other test that touches a database, on PostgreSQL with psycopg 3
  mariadb     every test that touches a database, on MariaDB (the "mariadb" extra's mysqlclient)
  psycopg2    the tests of what the driver changes, on PostgreSQL with psycopg2 (which Django
              falls back to where psycopg 3 is not installed)

PostgreSQL is looked for on PGHOST:PGPORT (default 127.0.0.1:5432, user postgres), MariaDB on
MARIADB_HOST:MARIADB_PORT (default 127.0.0.1:3306, user root); a pass whose server does not
answer, or whose driver is missing, is skipped, and with CI=true fails the run.

The passes run three at a time (--lanes), each on test databases, Redis databases and a
coverage file of its own; a pass's output is printed once it ends. The coverage of the passes is
combined and checked once SQLite's, PostgreSQL's (both drivers) and MariaDB's have run.

Arguments other than the options below are passed to pytest. Tests named there (a file, a
directory, a test's id) replace each pass's own choice of tests (a fault test runs in the faults
and pgbouncer passes, not in postgresql's), and the example project's tests and the coverage
floor are then left out; options (-x, --ignore=...) apply to every pass's choice.

  --installed        test the django-idempotency that is installed (the built wheel, as tox
                     installs it), not this checkout's source, which is then kept off sys.path.
  --databases NAMES  run only these passes, by name, such as "sqlite,postgresql" (default:
                     all of them).
  --lanes N          how many passes run at once (default 3; 1 runs them one after the other,
                     their output printed as it comes).

Deprecation warnings that django_idempotency's own modules cause are errors in every pass, also
those raised while Django starts, before pytest's own filters apply.

Each pytest pass writes a JUnit report into TEST_REPORTS (default: a new temporary directory).
The last line printed is the totals of every report there, so runs that share one TEST_REPORTS
directory (say, one per Python and Django) end with the totals of them all.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping

ROOT = Path(__file__).resolve().parent
PACKAGE = "django_idempotency"
# 97, not 98, since the broker consumer's outage and shutdown paths and the queue commands'
# --forever loop are proven in the black-box tests, whose subprocesses coverage does not measure
# yet: measured there too (COVERAGE_PROCESS_START), the floor goes back to 98.
COVERAGE_FLOOR = 97
# The passes whose coverage, together, the floor applies to: what PgBouncer adds is its own.
COVERED_BY = {"sqlite", "postgresql", "psycopg2", "mariadb"}
# Debian installs pgbouncer in /usr/sbin, which an unprivileged PATH may lack.
PGBOUNCER_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"])


def answers(host_variable: str, port_variable: str, default_port: int) -> Callable[[], bool]:
    """Whether a server answers on the host and port that the environment names."""

    def reachable() -> bool:
        host = os.environ.get(host_variable, "127.0.0.1")
        port = int(os.environ.get(port_variable, str(default_port)))
        try:
            with socket.create_connection((host, port), timeout=2):
                return True
        except OSError:
            return False

    return reachable


@contextlib.contextmanager
def no_server() -> Iterator[dict[str, str]]:
    yield {}


@contextlib.contextmanager
def through_pgbouncer() -> Iterator[dict[str, str]]:
    """A PgBouncer of the pass's own in front of PostgreSQL, and a test database of its own.

    Django would create its test database through the pooler and then fail to drop it, the
    pooler holding connections to it: the pass keeps it (--reuse-db), and it is dropped here,
    on the server itself, before and after.
    """
    from tests.pgbouncer import PgBouncer  # noqa: PLC0415 - this pass alone needs it

    name = os.environ.get("TEST_PG_NAME", "django_idempotency") + "_pgbouncer"
    drop_postgresql_database(f"test_{name}")
    pgbouncer = PgBouncer()
    pgbouncer.start()
    try:
        yield {
            "TEST_PG_NAME": name,
            "TEST_PGBOUNCER_PORT": str(pgbouncer.port),
            "PYTEST_ADDOPTS": " ".join(
                filter(None, [os.environ.get("PYTEST_ADDOPTS"), "--reuse-db"])
            ),
        }
    finally:
        pgbouncer.stop()
        drop_postgresql_database(f"test_{name}")


def drop_postgresql_database(name: str) -> None:
    import psycopg  # noqa: PLC0415 - the test extra's driver
    from psycopg import sql  # noqa: PLC0415

    with psycopg.connect(
        host=os.environ.get("PGHOST", "127.0.0.1"),
        port=os.environ.get("PGPORT", "5432"),
        user=os.environ.get("PGUSER", "postgres"),
        password=os.environ.get("PGPASSWORD", ""),
        dbname="postgres",
        autocommit=True,
    ) as connection:
        connection.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@dataclass(frozen=True)
class DatabasePass:
    """One run of the suite on one database (TEST_DATABASE in tests/settings.py)."""

    name: str
    database: str  # its name for --databases, and its TEST_DATABASE unless `environ` sets one
    reachable: Callable[[], bool] = lambda: True
    driver: str = ""  # a module the pass needs
    extra: str = "test"  # the extra that installs it
    environ: tuple[tuple[str, str], ...] = ()  # more of the pass's environment
    # Which tests, when not all of them: what this pass changes.
    selection: tuple[str, ...] = ()
    # The pass's tests are those under this directory (a test named there runs in it alone)...
    within: str = ""
    # ... or all but those (a test named there does not run in it).
    without: str = ""
    # Starts what the pass connects through, and gives more of its environment.
    server: Callable[[], contextlib.AbstractContextManager[dict[str, str]]] = no_server
    # Keeps its PostgreSQL test database apart from another pass's on the same server.
    pg_name_suffix: str = ""

    @property
    def choice(self) -> tuple[str, ...]:
        """The pytest arguments that choose the pass's tests."""
        if self.within:
            return (*self.selection, self.within)
        if self.without:
            return (*self.selection, f"--ignore={self.without}")
        return self.selection

    def tests(self, named: list[str]) -> list[str]:
        """Those of the ``named`` tests that this pass runs."""

        def inside(test: str) -> bool:
            directory = ROOT / (self.within or self.without)
            return Path(test.split("::", maxsplit=1)[0]).resolve().is_relative_to(directory)

        if self.within:
            return [test for test in named if inside(test)]
        if self.without:
            return [test for test in named if not inside(test)]
        return named

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """What keeps the pass apart from the others that run at the same time."""
        index = DATABASE_PASSES.index(self)
        return {
            "TEST_PG_NAME": env.get("TEST_PG_NAME", "django_idempotency") + self.pg_name_suffix,
            # Redis databases 15 and 14 for the first pass, 13 and 12 for the second, and so on.
            "TEST_REDIS_CACHE_DB": str(15 - 2 * index),
            "TEST_REDIS_CELERY_DB": str(14 - 2 * index),
            # Combined with the other passes' once they have all run.
            "COVERAGE_FILE": str(ROOT / f".coverage.{self.database}"),
        }


POSTGRESQL = answers("PGHOST", "PGPORT", 5432)
# What psycopg2 changes (errors, notifications, how values reach the library): the store, the
# leases, the inbox and the outbox, their purges, and the fault tests of lost connections, killed
# and frozen workers.
DRIVER_BOUND = [
    *(
        f"tests/test_{name}.py"
        for name in [
            "store",
            "lease",
            "replays",
            "transactions",
            "purging",
            "inbox_receiving",
            "inbox_processing",
            "inbox_worker",
            "outbox",
        ]
    ),
    *(f"tests/blackbox/test_{name}.py" for name in ["faults", "key_spellings", "slow_worker"]),
]
# In the order they start: the longest first, so that the lanes end together.
DATABASE_PASSES = [
    # A pooler changes what a connection and a session are: the races, the leases and the
    # black-box fault tests, through a PgBouncer in transaction pooling mode. The broker fault
    # test is left out: a consumer's transaction is like any other there.
    DatabasePass(
        "PostgreSQL through PgBouncer",
        "pgbouncer",
        lambda: POSTGRESQL() and shutil.which("pgbouncer", path=PGBOUNCER_PATH) is not None,
        environ=(("TEST_DATABASE", "postgresql"),),
        selection=(
            "-m",
            "server_db or postgresql or pgbouncer or pooled",
            "--ignore-glob=tests/blackbox/test_broker*.py",
        ),
        server=through_pgbouncer,
    ),
    # PostgreSQL's tests in two passes, which may run at the same time: the fault tests, which
    # serve the example project in processes of their own, and the rest.
    DatabasePass(
        "PostgreSQL: the fault tests, the example project served",
        "faults",
        POSTGRESQL,
        environ=(("TEST_DATABASE", "postgresql"),),
        within="tests/blackbox",
        pg_name_suffix="_faults",
    ),
    # The tests that touch no database run here alone.
    DatabasePass("SQLite", "sqlite"),
    DatabasePass("PostgreSQL", "postgresql", POSTGRESQL, without="tests/blackbox"),
    DatabasePass(
        "MariaDB", "mariadb", answers("MARIADB_HOST", "MARIADB_PORT", 3306), "MySQLdb", "mariadb"
    ),
    DatabasePass(
        "PostgreSQL with psycopg2",
        "psycopg2",
        POSTGRESQL,
        "psycopg2",
        environ=(("TEST_DATABASE", "postgresql"), ("TEST_PG_DRIVER", "psycopg2")),
        selection=tuple(DRIVER_BOUND),
        pg_name_suffix="_psycopg2",
    ),
]

# Each pytest pass writes a JUnit report here; the totals of them all are printed last.
REPORTS = Path(os.environ.get("TEST_REPORTS") or tempfile.mkdtemp(prefix="test-reports-"))
REPORTS.mkdir(parents=True, exist_ok=True)


def report_name(what: str, later: int = 0) -> str:
    """A new report's file name, in the order started, saying which Python and Django ran it.

    ``later``: how many reports, not yet written, are to come before it.
    """
    number = len(list(REPORTS.glob("*.xml"))) + later + 1
    python = ".".join(platform.python_version_tuple()[:2])
    return f"{number:02d}-py{python}-django{version('django')}-{what}.xml"


def run(title: str, command: list[str], cwd: Path, env: dict[str, str], report: str = "") -> None:
    print(f"\n=== {title}", flush=True)
    if report:
        command = [*command, f"--junitxml={REPORTS / report}"]
    completed = subprocess.run(command, cwd=cwd, env=env, check=False)
    if completed.returncode != 0:
        sys.exit(completed.returncode)


def count(report: Path) -> Counter[str]:
    totals: Counter[str] = Counter()
    for suite in ET.parse(report).getroot().iter("testsuite"):  # noqa: S314 - our own file
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        totals.update(passed=tests - skipped - failed, failed=failed, skipped=skipped)
    return totals


def in_words(counts: Counter[str]) -> str:
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"


@atexit.register
def print_totals() -> None:
    """End with every pass's totals on one line, in pytest's words, failures included."""
    reports = sorted(REPORTS.glob("*.xml"))
    totals: Counter[str] = Counter()
    print(f"\n=== totals of {len(reports)} test passes", flush=True)
    for report in reports:
        counts = count(report)
        totals.update(counts)
        print(f"  {report.stem}: {in_words(counts)}")
    print(in_words(totals), flush=True)


def own_deprecations_are_errors() -> str:
    """PYTHONWARNINGS entries that make deprecation warnings caused by our modules errors.

    -W and PYTHONWARNINGS match a module's name exactly, so every module is named.
    """
    modules = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    categories = ["DeprecationWarning", "PendingDeprecationWarning"]
    return ",".join(f"error::{category}:{module}" for module in modules for category in categories)


def installed_package(env: dict[str, str]) -> Path:
    """The directory django_idempotency imports from, as the passes will see it."""
    where = subprocess.run(
        [sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__path__[0])"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if where.returncode != 0:
        sys.exit(f"--installed: {PACKAGE} is not installed:\n{where.stderr}")
    package = Path(where.stdout.strip()).resolve()
    if package == ROOT / PACKAGE:
        sys.exit(f"--installed: {PACKAGE} imports from this checkout ({package}): install a wheel")
    return package


def environment(installed: bool) -> tuple[dict[str, str], list[str]]:
    """The passes' environment, and the pytest options that go with it."""
    warnings = [os.environ.get("PYTHONWARNINGS", ""), own_deprecations_are_errors()]
    env = {**os.environ, "PYTHONWARNINGS": ",".join(filter(None, warnings))}
    if not installed:
        return env, ["--cov"]
    # The tests import as the `tests` package from a directory that holds nothing else, and
    # neither the working directory (PYTHONSAFEPATH, inherited by the tests' own subprocesses)
    # nor pytest's rootdir (appended, not prepended) comes before the installed package.
    shim = Path(tempfile.mkdtemp(prefix="installed-tests-"))
    (shim / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    paths = [str(shim), os.environ.get("PYTHONPATH", "")]
    env.update(PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join(filter(None, paths)))
    package = installed_package(env)
    print(f"Testing the installed {PACKAGE}: {package}", flush=True)
    return env, ["--import-mode=append", f"--cov={package}"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False, add_help=False
    )
    parser.add_argument("--installed", action="store_true")
    names = [database.database for database in DATABASE_PASSES]
    parser.add_argument("--databases", type=lambda given: given.split(","), default=names)
    parser.add_argument("--lanes", type=int, default=3)
    options, args = parser.parse_known_args(argv)
    if unknown := set(options.databases) - set(names):
        parser.error(f"--databases: unknown {', '.join(sorted(unknown))}; known {', '.join(names)}")
    if options.lanes < 1:
        parser.error("--lanes: at least 1")
    env, options_of_env = environment(options.installed)
    # Tests named on the command line replace each pass's own choice; options add to it.
    named = [arg for arg in args if Path(arg.split("::")[0]).exists()]
    chose_tests = bool(named)
    pytest = [sys.executable, "-m", "pytest", *options_of_env, "--cov-report="]
    pytest += [arg for arg in args if arg not in named]

    chosen = [d for d in DATABASE_PASSES if d.database in options.databases]
    passes = [d for d in reachable_passes(chosen) if not chose_tests or d.tests(named)]
    runs = []
    # The tests that touch no database run once: in SQLite's pass, or else in the first.
    free = next((d for d in passes if d.database == "sqlite"), passes[0] if passes else None)
    for number, database in enumerate(passes):
        # Unless tests are named, a pass runs those its database changes.
        command = [*pytest, *(database.tests(named) if chose_tests else database.choice)]
        environ = {**env, **database.environment(env), "TEST_DATABASE": database.database}
        environ.update(database.environ)
        if database is not free:
            environ["TEST_DATABASE_BOUND_ONLY"] = "1"
        runs.append(PassRun(database, command, environ, report_name(database.database, number)))
    for stale in ROOT.glob(".coverage*"):
        stale.unlink()
    run_all(runs, options.lanes)

    ran = {run.database.database for run in runs}
    if ran >= COVERED_BY:
        combine = [sys.executable, "-m", "coverage", "combine", "-q"]
        run("coverage: the passes' data combined", combine, ROOT, env)
        floor = [f"--fail-under={COVERAGE_FLOOR}"] if not chose_tests else []
        coverage = [sys.executable, "-m", "coverage", "report", *floor]
        run(f"coverage of the {len(ran)} database passes", coverage, ROOT, env)
    if not chose_tests:
        example = [sys.executable, "-m", "pytest", "-q"]
        run("example project", example, ROOT / "example_project", env, report_name("example"))


def reachable_passes(chosen: list[DatabasePass]) -> list[DatabasePass]:
    """The chosen passes whose server answers and whose driver is installed; with CI=true, all."""
    ci = os.environ.get("CI", "").lower() == "true"
    passes = []
    for database in chosen:
        if not database.reachable():
            if ci:
                sys.exit(f"{database.name} is not reachable, and CI=true requires it.")
            print(f"\n{database.name} is not reachable: its tests were skipped.", flush=True)
            continue
        if database.driver and importlib.util.find_spec(database.driver) is None:
            missing = (
                f"{database.name}'s driver is not installed (pip install -e '.[{database.extra}]')"
            )
            if ci:
                sys.exit(f"{missing}, and CI=true requires it.")
            print(f"\n{missing}: its tests were skipped.", flush=True)
            continue
        passes.append(database)
    return passes


@dataclass(frozen=True)
class PassRun:
    """One pass, ready to run: its pytest command, its environment, its report's name."""

    database: DatabasePass
    command: list[str]
    environ: dict[str, str]
    report: str

    @property
    def title(self) -> str:
        return f"tests on {self.database.name}"

    def __call__(self, output: IO[str] | None) -> int:
        """Run the pass, its output to ``output`` (or to ours); return pytest's exit status."""
        started = time.monotonic()
        with self.database.server() as server_environ:
            completed = subprocess.run(
                [*self.command, f"--junitxml={REPORTS / self.report}"],
                cwd=ROOT,
                env={**self.environ, **server_environ},
                stdout=output,
                stderr=subprocess.STDOUT if output else None,
                check=False,
            )
        print(f"\n=== {self.title}: {time.monotonic() - started:.0f} s", flush=True)
        return completed.returncode


def run_all(runs: list[PassRun], lanes: int) -> None:
    """Run the passes, ``lanes`` at a time; exit with the status of the first that failed.

    Once one fails, no other starts. With more than one lane each pass's output is printed
    whole once it ends, so that two passes' lines do not mix.
    """
    if lanes == 1:
        for one in runs:
            print(f"\n=== {one.title}", flush=True)
            if status := one(None):
                sys.exit(status)
        return
    failed: list[int] = []
    printing = threading.Lock()

    def lane(one: PassRun) -> None:
        if failed:
            return
        with tempfile.TemporaryFile("w+") as output:
            print(f"\n=== {one.title}: started", flush=True)
            status = one(output)
            output.seek(0)
            with printing:
                print(f"\n=== {one.title}", flush=True)
                shutil.copyfileobj(output, sys.stdout)
                sys.stdout.flush()
        if status:
            failed.append(status)

    with ThreadPoolExecutor(max_workers=lanes) as executor:
        list(executor.map(lane, runs))
    if failed:
        sys.exit(failed[0])


if __name__ == "__main__":
    main(sys.argv[1:])
