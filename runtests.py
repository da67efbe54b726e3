#!/usr/bin/env python
"""Run the test suite on SQLite, then on PostgreSQL, then the example project's tests.

PostgreSQL is used when it answers on PGHOST:PGPORT (default 127.0.0.1:5432, user postgres).
With CI=true a PostgreSQL that does not answer is a failure, not a skip. Extra arguments are
passed to pytest. Coverage of both database runs is combined and checked.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent
COVERAGE_FLOOR = 98


def postgres_reachable() -> bool:
    host = os.environ.get("PGHOST", "127.0.0.1")
    port = int(os.environ.get("PGPORT", "5432"))
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


# Each pytest pass writes a JUnit report here; the totals of them all are printed last.
REPORTS = Path(tempfile.mkdtemp(prefix="test-reports-"))
TOTALS: Counter[str] = Counter()


def run(title: str, command: list[str], cwd: Path = ROOT, **env: str) -> None:
    print(f"\n=== {title}", flush=True)
    if "pytest" in command:
        command = [*command, f"--junitxml={REPORTS / f'{len(list(REPORTS.iterdir()))}.xml'}"]
    completed = subprocess.run(command, cwd=cwd, env={**os.environ, **env}, check=False)
    if completed.returncode != 0:
        sys.exit(completed.returncode)


def count(report: Path) -> None:
    for suite in ET.parse(report).getroot().iter("testsuite"):  # noqa: S314 - our own file
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        TOTALS.update(passed=tests - skipped - failed, failed=failed, skipped=skipped)


@atexit.register
def print_totals() -> None:
    """End with every pass's totals on one line, in pytest's words, failures included."""
    for report in sorted(REPORTS.glob("*.xml")):
        count(report)
    passes = len(list(REPORTS.glob("*.xml")))
    print(f"\n=== totals of {passes} test passes", flush=True)
    print(f"{TOTALS['passed']} passed, {TOTALS['failed']} failed, {TOTALS['skipped']} skipped")


def main(args: list[str]) -> None:
    ci = os.environ.get("CI", "").lower() == "true"
    pytest = [sys.executable, "-m", "pytest", "--cov", "--cov-report=", *args]
    run("tests on SQLite", pytest, TEST_DATABASE="sqlite")
    if postgres_reachable():
        run("tests on PostgreSQL", [*pytest, "--cov-append"], TEST_DATABASE="postgresql")
        floor = [f"--fail-under={COVERAGE_FLOOR}"] if not args else []
        run("coverage of both runs", [sys.executable, "-m", "coverage", "report", *floor])
    elif ci:
        print("PostgreSQL is not reachable, and CI=true requires it.", file=sys.stderr)
        sys.exit(1)
    else:
        print("\nPostgreSQL is not reachable: its tests were skipped.", flush=True)
    if not args:
        run("example project", [sys.executable, "-m", "pytest", "-q"], ROOT / "example_project")


if __name__ == "__main__":
    main(sys.argv[1:])
