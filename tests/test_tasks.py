"""The lifecycle tasks, executed by a real Celery worker over a Redis broker, on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from django_idempotency.models import IdempotencyKey
from django_idempotency.tasks import purge_expired_keys, sweep_expired_leases
from tests.celery_app import app
from tests.test_purge import make_many_keys

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.postgresql, pytest.mark.redis, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def worker():
    env = {
        **os.environ,
        "TEST_DATABASE": "postgresql",
        "TEST_PG_NAME": connection.settings_dict["NAME"],
    }
    app.control.purge()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            "4",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=ROOT,
        env=env,
    )
    deadline = time.monotonic() + 60
    while not app.control.ping(timeout=0.5):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail("the Celery worker did not start")
    yield
    process.terminate()
    process.wait(timeout=30)


def run(task, **kwargs):
    """Send ``task`` to the worker; the tasks ignore results, which these tests read."""
    return task.apply_async(kwargs=kwargs, ignore_result=False)


def test_purge_fired_twice_at_once_then_again_ends_as_once(worker):
    expired = make_many_keys(20_000)
    first, second = run(purge_expired_keys, batch_size=1_000), run(purge_expired_keys)
    deleted = first.get(timeout=60) + second.get(timeout=60)
    again = [run(purge_expired_keys).get(timeout=60) for _ in range(2)]

    assert deleted == expired == 10_000
    assert again == [0, 0]
    assert IdempotencyKey.objects.count() == 10_000
    assert not IdempotencyKey.objects.filter(expires_at__lte=timezone.now()).exists()


def test_sweep_fired_twice_at_once_then_again_takes_each_lease_once(worker):
    past = timezone.now() - timedelta(minutes=5)
    IdempotencyKey.objects.bulk_create(
        IdempotencyKey(
            scope="s",
            key=f"k{n}",
            method="POST",
            route="r/",
            fingerprint="f" * 64,
            created_at=past,
            expires_at=past + timedelta(days=1),
            locked_until=past,
        )
        for n in range(500)
    )
    results = [run(sweep_expired_leases), run(sweep_expired_leases)]
    swept = sum(result.get(timeout=60) for result in results)
    again = [run(sweep_expired_leases).get(timeout=60) for _ in range(2)]

    assert swept == 500
    assert again == [0, 0]
    assert IdempotencyKey.objects.filter(state="failed", lease_version=2).count() == 500
