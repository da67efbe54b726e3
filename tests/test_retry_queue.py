"""The retry queue that the inbox and the outbox share: what a failed attempt leaves behind."""

from __future__ import annotations

from django_idempotency.retry_queue import ERROR_MAX_LENGTH, error_text


class LedgerError(Exception):
    pass


def test_an_error_is_kept_as_its_type_and_message():
    assert error_text(LedgerError("the ledger is unavailable")) == (
        "LedgerError: the ledger is unavailable"
    )


def test_a_long_error_message_is_cut_to_the_bound():
    text = error_text(LedgerError("x" * 10 * ERROR_MAX_LENGTH))

    assert len(text) == ERROR_MAX_LENGTH
    assert text.startswith("LedgerError: xxx")
