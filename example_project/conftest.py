"""The example's tests roll each test back: counts deferred by one test must not outlive it."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_deferred_counts():
    from django_idempotency.inbox.receiving import delivery_counts  # noqa: PLC0415
    from django_idempotency.store import replay_counts  # noqa: PLC0415

    yield
    for counts in (replay_counts, delivery_counts):
        counts.discard()
