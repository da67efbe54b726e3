"""A worker process for the lease tests: sends one lease-mode request that holds, to be killed.

Run as ``python -m tests.lease_worker USERNAME KEY`` with TEST_DATABASE and TEST_PG_NAME (or
TEST_MARIADB_NAME) set to the test database.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402

from tests.conftest import ApiClient  # noqa: E402

if __name__ == "__main__":
    username, key = sys.argv[1:3]
    client = ApiClient(get_user_model().objects.get(username=username))
    client.send("POST", "/lease-recovering/", {"amount": 700}, key=key, headers={"X-Hold": "60"})
