"""A stand-in for a payment provider: its charges commit at once, outside our transaction."""

from __future__ import annotations

import threading

from django.db import connection
from django.db.models import F

from tests.testapp.models import Charge


def _elsewhere(work):
    """Run ``work()`` on a connection of its own, as a call to another system would."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as exc:  # handed to the caller
            result["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def charge(key, amount):
    """Charge ``amount``; the same key returns the first charge, as idempotent providers do."""

    def work():
        record, _created = Charge.objects.get_or_create(key=key, defaults={"amount": amount})
        Charge.objects.filter(pk=record.pk).update(calls=F("calls") + 1)
        return record

    return _elsewhere(work)


def find_charge(key):
    return _elsewhere(lambda: Charge.objects.filter(key=key).first())
