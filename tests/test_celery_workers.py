"""Idempotent Celery tasks (``django_idempotency.celery``) with real workers, on PostgreSQL.

A worker process per test, over Redis or RabbitMQ: duplicates sent at once, workers killed mid-task,
retries, two workers racing.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from django_idempotency.models import IdempotencyKey
from tests.conftest import CI, process_env
from tests.task_worker import LEASE_TIMEOUT, QUEUE, make_app
from tests.testapp.models import Refund

ROOT = Path(__file__).resolve().parent.parent


def key_row(**lookup):
    return IdempotencyKey.objects.get(**lookup)


# With real workers, on PostgreSQL: a worker process per test, over Redis or RabbitMQ.


def reachable(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


BROKER_PORTS = {"redis": 6379, "rabbitmq": 5672}


class Workers:
    """Celery workers on one broker; the test may kill one and start another."""

    def __init__(self, broker):
        self.broker = broker
        self.app = make_app(broker)
        self.processes = []

    def start(self, concurrency=8):
        env = process_env(TEST_TASK_BROKER=self.broker)
        # Its own name: other workers may share the broker, and answer pings too.
        hostname = f"tasks-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
        command = [
            sys.executable, "-m", "celery", "-A", "tests.task_worker", "worker",
            "--pool", "threads", "--concurrency", str(concurrency), "--loglevel", "ERROR",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "--hostname", hostname,
        ]  # fmt: skip
        process = subprocess.Popen(command, cwd=ROOT, env=env)
        self.processes.append(process)
        deadline = time.monotonic() + 60
        while not self.app.control.ping(destination=[hostname], timeout=0.5):
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("the Celery worker did not start")
        return process

    def send(self, name, *args, **kwargs):
        return self.app.send_task(name, args, kwargs)

    def stop(self):
        # Every task the test sent has finished: no need to wait for a warm shutdown.
        for process in self.processes:
            process.kill()
            process.wait()


@pytest.fixture(params=["redis", "rabbitmq"])
def workers(request):
    broker = request.param
    if not reachable(BROKER_PORTS[broker]):
        if CI:
            pytest.fail(f"{broker} is not reachable on 127.0.0.1:{BROKER_PORTS[broker]}")
        pytest.skip(f"needs {broker} on 127.0.0.1:{BROKER_PORTS[broker]}")
    pool = Workers(broker)
    pool.app.control.purge()
    yield pool
    pool.stop()
    pool.app.control.purge()
    if broker == "rabbitmq":
        with pool.app.connection_for_write() as connection:
            connection.default_channel.queue_delete(QUEUE)


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.05)


def started(path):
    return path.exists() and "started" in path.read_text()


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_the_same_task_sent_50_times_at_once_has_one_effect(workers):
    workers.start()
    label = uuid.uuid4().hex
    with ThreadPoolExecutor(10) as pool:
        sent = list(pool.map(lambda _: workers.send("tests.refund", label, 50), range(50)))
    results = [result.get(timeout=60) for result in sent]

    assert Refund.objects.filter(event_id=label).count() == 1
    # Every duplicate got the result the one run stored.
    assert len({json.dumps(result, sort_keys=True) for result in results}) == 1
    # The worker writes its replay counts a second after counting them.
    wait_for(lambda: key_row(key=label).replay_count == 49, timeout=10)


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_the_task_runs_with_the_correlation_id_it_was_sent_with(workers):
    # As CeleryTaskDispatcher sends an outbox message's: a message header, which the worker
    # merges into the task's request.
    workers.start(concurrency=1)
    label = uuid.uuid4().hex
    result = workers.app.send_task(
        "tests.refund", (label, 1), headers={"X-Correlation-ID": f"corr-{label}"}
    )

    assert result.get(timeout=60)["correlation_id"] == f"corr-{label}"


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_task_is_redelivered_and_the_effect_happens_once(workers, tmp_path):
    killed = workers.start()
    label, hold, marks = uuid.uuid4().hex, tmp_path / "hold", tmp_path / "started"
    hold.touch()
    result = workers.send("tests.refund", label, 7, started=str(marks), hold=str(hold))
    wait_for(lambda: started(marks))
    killed.kill()  # SIGKILL: no goodbye to the broker, the transaction left open
    killed.wait()
    hold.unlink()
    workers.start()

    assert result.get(timeout=30)["label"] == label
    assert marks.read_text().count("started") == 2  # delivered again after the kill
    assert Refund.objects.filter(event_id=label).count() == 1


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_a_body_that_raises_then_succeeds_on_retry_has_one_effect(workers, tmp_path):
    workers.start()
    label, failures = uuid.uuid4().hex, tmp_path / "failures"
    failures.write_text("first\nsecond\n")
    result = workers.send("tests.refund", label, 3, failures=str(failures))

    assert result.get(timeout=30)["amount"] == 3
    assert failures.read_text() == ""  # two attempts failed, the third succeeded
    assert Refund.objects.filter(event_id=label).count() == 1
    assert key_row(key=label).state == "succeeded"


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_two_workers_racing_one_runs_and_the_other_returns_its_result(workers, tmp_path):
    workers.start(concurrency=1)
    workers.start(concurrency=1)
    label = uuid.uuid4().hex
    first = workers.send("tests.refund", label, 9, pause=1.0)
    second = workers.send("tests.refund", label, 9, pause=1.0)

    one, other = first.get(timeout=30), second.get(timeout=30)
    assert first.worker != second.worker  # each worker took one
    assert one == other  # the same run: the duplicate waited for it and returned its result
    assert Refund.objects.filter(event_id=label).count() == 1
    wait_for(lambda: key_row(key=label).replay_count == 1, timeout=10)


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_task_killed_after_its_effect_is_recovered_not_repeated(workers, tmp_path):
    killed = workers.start()
    payment, effects = uuid.uuid4().hex, tmp_path / "sent"
    hold, marks = tmp_path / "hold", tmp_path / "started"
    hold.touch()
    result = workers.send(
        "tests.send_receipt", payment, str(effects), started=str(marks), hold=str(hold)
    )
    wait_for(lambda: started(marks))
    killed.kill()
    killed.wait()
    hold.unlink()
    workers.start()

    # The redelivery waits for the dead worker's lease to run out, then takes the key over; the
    # recover hook finds the receipt sent, so the body does not run again.
    answer = result.get(timeout=30 + LEASE_TIMEOUT)
    assert answer == {"payment": payment, "recovered": True, "attempt": 2}
    assert effects.read_text().split() == [payment]


@pytest.mark.postgresql
@pytest.mark.redis  # the result backend, whichever the broker
@pytest.mark.django_db(transaction=True)
def test_a_lease_mode_task_sent_many_times_at_once_sends_once(workers, tmp_path):
    workers.start()
    payment, effects = uuid.uuid4().hex, tmp_path / "sent"
    sent = [workers.send("tests.send_receipt", payment, str(effects)) for _ in range(20)]
    results = [result.get(timeout=60) for result in sent]

    assert effects.read_text().split() == [payment]
    assert {json.dumps(result) for result in results} == {
        json.dumps({"payment": payment, "recovered": False})
    }
