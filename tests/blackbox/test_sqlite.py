"""Storms on SQLite, black-box: the example project served by gunicorn on a SQLite file.

SQLite lets one connection write at a time. A transaction that has read and then writes while
another connection writes fails at once with "database is locked": SQLite does not wait its busy
timeout then, lest the two wait on each other. These tests deliver one webhook many times at
once, and make many charges at once, and ask that every delivery and every outbox message is
handled there and then, in SQLite's own (deferred) transaction mode and in IMMEDIATE mode.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from django_idempotency.signing import StripeSignature
from tests.blackbox.harness import PROVIDER_SECRET, wait_for

pytestmark = pytest.mark.sqlite

STORM = 32
MODES = [pytest.param("", id="deferred"), pytest.param("IMMEDIATE", id="immediate")]
LOCKED = "database is locked"
# Processed "at once": by the dispatch after the recording committed, long before the periodic
# run (a minute later) would take the event.
AT_ONCE = 5.0


def settles(read, expected, timeout: float = AT_ONCE):
    """Poll ``read()`` until it returns ``expected`` or ``timeout`` seconds pass; return it then."""
    try:
        return wait_for(lambda: (found := read()) == expected and found, timeout=timeout)
    except AssertionError:
        return read()


def storm(send, times: int = STORM) -> list:
    """Call ``send(index)`` ``times`` times at once, from as many threads; return the answers."""
    start = threading.Barrier(times)

    def one(index: int):
        start.wait()
        return send(index)

    with ThreadPoolExecutor(times) as pool:
        return list(pool.map(one, range(times)))


@pytest.mark.parametrize("mode", MODES)
def test_a_webhook_delivered_many_times_at_once_is_processed_at_once(
    serve_sqlite, sqlite_database, mode
):
    server = serve_sqlite(BLACKBOX_SQLITE_TRANSACTION_MODE=mode)
    event = {"id": "evt_storm", "type": "refund.pending", "data": {"refund": 1, "sequence": 1}}
    body = json.dumps(event).encode()
    headers = list(StripeSignature([PROVIDER_SECRET]).sign(body).items())

    answers = storm(lambda _: server.send("POST", "/webhooks/provider/", body, headers=headers))

    said = Counter((answer.status, answer.field("status")) for answer in answers)
    state = settles(
        lambda: sqlite_database.execute(
            "SELECT status, attempts FROM django_idempotency_inboxevent WHERE event_id = ?",
            (event["id"],),
        ),
        [("processed", 1)],
    )
    assert said == {(200, "processed"): 1, (200, "duplicate"): STORM - 1}, f"event: {state}"
    assert state == [("processed", 1)]
    assert LOCKED not in server.log()


class _Sink(BaseHTTPRequestHandler):
    """Another service's webhook endpoint: takes every delivery, keeps its message id."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append(self.headers["webhook-id"])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def sink():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize("mode", MODES)
def test_charges_made_at_once_are_each_relayed_at_once(serve_sqlite, sqlite_database, sink, mode):
    host, port = sink.server_address[:2]
    server = serve_sqlite(
        BLACKBOX_SQLITE_TRANSACTION_MODE=mode,
        # Quick: in IMMEDIATE mode each charge holds the write lock while the provider takes it.
        EXAMPLE_PROVIDER_LATENCY="0.05",
        # Elsewhere, not back to this server: its threads would all wait on their own relays.
        PAYMENT_EVENTS_URL=f"http://{host}:{port}/",
    )
    payment = {"amount": 1000, "currency": "eur", "description": "a book"}

    answers = storm(lambda index: server.post_json("/api/charges/", payment, key=f"c-{index}"))

    assert Counter(answer.status for answer in answers) == {201: STORM}, [
        str(answer) for answer in answers if answer.status != 201
    ]

    relayed = settles(
        lambda: sqlite_database.execute(
            "SELECT status, count(*) FROM django_idempotency_outboxmessage GROUP BY status"
        ),
        [("dispatched", STORM)],
    )
    assert relayed == [("dispatched", STORM)]
    assert len(set(sink.received)) == STORM
    failed_relays = server.log().count("could not relay the outbox after a commit")
    assert (failed_relays, LOCKED in server.log()) == (0, False)
