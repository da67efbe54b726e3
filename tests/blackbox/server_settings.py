"""The example project as the fault tests serve it: its own settings, made quiet and quick."""

from __future__ import annotations

from example_project.settings import *  # noqa: F403

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
