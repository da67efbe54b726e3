"""Idempotent tasks of Django's Tasks framework with django-tasks-db's real ``db_worker``, on
PostgreSQL and MariaDB: the same task enqueued 20 times, its first run's worker killed (SIGKILL)
mid-task, another worker started. The framework never runs a killed worker's task again (its
result stays RUNNING): the other 19 are the run again, and exactly one effect is counted.
"""

from __future__ import annotations

import time
import uuid

import pytest

from django_idempotency.core import optional
from tests.conftest import CI, start_command

if not optional.installed("django_tasks_db"):
    if CI:
        pytest.fail("django-tasks-db is not installed", pytrace=False)
    pytest.skip("needs django-tasks-db", allow_module_level=True)

from django_tasks_db.models import DBTaskResult

from tests.django_task_worker import LEASE_TIMEOUT, refund, send_receipt
from tests.testapp.models import Refund

pytestmark = [pytest.mark.server_db, pytest.mark.django_db(transaction=True)]


class Workers:
    """``manage.py db_worker`` processes on the test database; the test may kill one."""

    def __init__(self):
        self.processes = []

    def start(self):
        process = start_command(
            "db_worker", "--backend", "database", "--interval", "0.05", "--no-startup-delay",
            "--no-reload", "--verbosity", "0",
        )  # fmt: skip
        self.processes.append(process)
        return process

    def kill(self, process):
        process.kill()  # SIGKILL: the run's transaction and connection are left as they were
        process.wait()

    def stop(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.communicate()


@pytest.fixture
def workers():
    pool = Workers()
    yield pool
    pool.stop()


def wait_for(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.05)


def started(path):
    return path.exists() and "started" in path.read_text()


def statuses(results):
    return sorted(
        DBTaskResult.objects.filter(id__in=[result.id for result in results]).values_list(
            "status", flat=True
        )
    )


def test_a_task_enqueued_20_times_whose_worker_is_killed_mid_task_has_one_effect(workers, tmp_path):
    label, hold, marks = uuid.uuid4().hex, tmp_path / "hold", tmp_path / "started"
    hold.touch()
    results = [refund.enqueue(label, 7, started=str(marks), hold=str(hold)) for _ in range(20)]
    killed = workers.start()
    wait_for(lambda: started(marks))
    workers.kill(killed)
    hold.unlink()
    workers.start()

    # The killed worker's run stays RUNNING, never run again; the 19 others finish.
    wait_for(lambda: statuses(results) == ["RUNNING"] + ["SUCCESSFUL"] * 19)
    assert marks.read_text().count("started") == 2  # the killed run, then one more
    assert Refund.objects.filter(event_id=label).count() == 1
    returned = [
        DBTaskResult.objects.get(id=result.id).return_value
        for result in results
        if DBTaskResult.objects.get(id=result.id).status == "SUCCESSFUL"
    ]
    assert len(returned) == 19
    assert len({value["run"] for value in returned}) == 1  # one run; 18 duplicates got its result


def test_a_lease_mode_task_killed_after_its_effect_is_recovered_not_repeated(workers, tmp_path):
    payment, effects = uuid.uuid4().hex, tmp_path / "sent"
    hold, marks = tmp_path / "hold", tmp_path / "started"
    hold.touch()
    results = [
        send_receipt.enqueue(payment, str(effects), started=str(marks), hold=str(hold))
        for _ in range(20)
    ]
    killed = workers.start()
    wait_for(lambda: started(marks))
    # Another worker takes the duplicates while the first holds the key: each finds its lease
    # live and enqueues itself again, to run a moment later.
    workers.start()
    wait_for(lambda: DBTaskResult.objects.filter(status="FAILED").exists())
    workers.kill(killed)
    hold.unlink()

    # Nobody renews the dead run's lease: once it runs out, the next run takes the key over,
    # and the recover hook finds the receipt sent.
    def settled():
        return (
            DBTaskResult.objects.filter(status="SUCCESSFUL").count() == 19
            and not DBTaskResult.objects.filter(status="READY").exists()
        )

    wait_for(settled, timeout=60 + LEASE_TIMEOUT)
    assert effects.read_text().split() == [payment]
    returned = DBTaskResult.objects.filter(status="SUCCESSFUL").values_list(
        "return_value", flat=True
    )
    assert list(returned) == [{"payment": payment, "recovered": True}] * 19
    # The killed run stays RUNNING; each busy run failed, naming the run enqueued in its place.
    assert DBTaskResult.objects.filter(status="RUNNING").count() == 1
    busy = DBTaskResult.objects.filter(status="FAILED")
    assert set(busy.values_list("exception_class_path", flat=True)) == {
        "django_idempotency.exceptions.TaskInProgress"
    }
    assert statuses(results).count("RUNNING") == 1
