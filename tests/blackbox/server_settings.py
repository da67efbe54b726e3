"""The example project as the fault tests serve it: its own settings, made quiet and quick."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

if os.environ.get("TEST_PG_DRIVER") == "psycopg2":
    # runtests.py's psycopg2 pass: served as where psycopg 3 is not installed, as the tests run.
    sys.modules["psycopg"] = None  # type: ignore[assignment]

from example_project.settings import *  # noqa: F403

# A SQLite file of the test's own (the provider's ledger, if the project keeps one, beside it),
# in the transaction mode the test asks for: SQLite's own, DEFERRED, unless one is named.
if sqlite_path := os.environ.get("BLACKBOX_SQLITE_PATH"):
    DATABASES["default"]["NAME"] = sqlite_path  # noqa: F405
    if "provider" in DATABASES:  # noqa: F405
        DATABASES["provider"]["NAME"] = f"{sqlite_path}-provider"  # noqa: F405
    options = DATABASES["default"].setdefault("OPTIONS", {})  # noqa: F405
    if mode := os.environ.get("BLACKBOX_SQLITE_TRANSACTION_MODE"):
        options["transaction_mode"] = mode
    else:
        options.pop("transaction_mode", None)

# Through the PgBouncer of runtests.py's PgBouncer pass, set as the installation guide says.
if os.environ.get("BLACKBOX_BEHIND_PGBOUNCER"):
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True  # noqa: F405

# The outbox retries a failed dispatch within this many seconds, not 30: a test that stops the
# broker does not wait for the default schedule.
if retry_delay := os.environ.get("BLACKBOX_OUTBOX_RETRY_DELAY"):
    IDEMPOTENCY["OUTBOX_RETRY_DELAY"] = timedelta(seconds=float(retry_delay))  # noqa: F405
    IDEMPOTENCY["OUTBOX_RETRY_MAX_DELAY"] = timedelta(seconds=20 * float(retry_delay))  # noqa: F405
# A schedule made seconds long runs out of attempts in seconds too: ten attempts span about two
# hours by default, about half a minute from 0.5 s. A test that restarts the broker, on a machine
# slow enough that the restart takes that long, gives its messages more attempts.
if max_attempts := os.environ.get("BLACKBOX_OUTBOX_MAX_ATTEMPTS"):
    IDEMPOTENCY["OUTBOX_MAX_ATTEMPTS"] = int(max_attempts)  # noqa: F405

# A 500 must look like one, not like Django's debug page.
DEBUG = False
# HTTP Basic hashes the password on every request: a fast hasher keeps two shared cores free
# for the requests the tests time.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"django_idempotency": {"level": "INFO"}},
}
