"""One key, two spellings, black-box: a charge whose worker died is never made twice.

``Idempotency-Key: K`` and ``Idempotency-Key: "K"`` are one key (the draft's sf-string and its
bare token). A lease-mode charge whose worker is killed after the provider took the money is
retried with the other spelling once the lease ran out, with or without the sweeper settling
the key first: the recovery hook (or the sweeper's reconcile hook) must ask the provider about
the key the charge was made with, so that the books show one charge.
"""

from __future__ import annotations

import base64
import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.blackbox.harness import manage, wait_for

pytestmark = pytest.mark.postgresql

CHARGES = "/api/charges/"
CHARGE = {"amount": 2500, "currency": "eur", "description": "a card charge"}
LEASE = 1.0
# The worker lingers after the provider charged, long enough to be killed there.
AFTER_CHARGE = "3"

# Each key with its two spellings: bare, and as a structured-field string.
SPELLINGS = {
    "plain": ("spelt-{n}", '"spelt-{n}"'),
    "escaped": ('spelt"{n}\\x', '"spelt\\"{n}\\\\x"'),
}
CASES = [
    (name, order, sweep)
    for name, order, sweep in itertools.product(SPELLINGS, ("bare first", "quoted first"), (0, 1))
]


def case_id(case: tuple[str, str, int]) -> str:
    name, order, sweep = case
    return f"{name} key, {order}, {'swept' if sweep else 'not swept'}"


def test_a_retry_in_the_other_spelling_after_a_killed_charge_charges_once(serve, database):
    server = serve(
        EXAMPLE_LEASE_TIMEOUT=str(LEASE), EXAMPLE_PROVIDER_DELAY_AFTER_CHARGE=AFTER_CHARGE
    )
    outcomes = {}
    for n, case in enumerate(CASES):
        name, order, sweep = case
        first, second = SPELLINGS[name]
        if order == "quoted first":
            first, second = second, first
        outcomes[case_id(case)] = charge_killed_then_retried(
            server, database, first.format(n=n), second.format(n=n), sweep=bool(sweep)
        )

    once = {"provider charges": 1, "payments": 1, "retry": 201}
    assert outcomes == dict.fromkeys(outcomes, once), outcomes


def charge_killed_then_retried(server, database, first, second, *, sweep):
    """Charge with ``first``; kill the worker once the provider charged; retry with ``second``
    once the lease ran out (after a sweep, if asked); return what the books and retry show."""
    before = database.effects()
    while len(server.workers()) < server.WORKERS:  # a worker killed by the case before
        wait_for(lambda: len(server.workers()) == server.WORKERS, timeout=30, what="workers")
    doomed, other = server.workers()
    server.freeze(other)  # the charge can only go to the doomed worker
    try:
        with ThreadPoolExecutor(1) as pool:
            charging = pool.submit(server.post_json, CHARGES, CHARGE, key=first, timeout=60)
            wait_for(
                lambda: database.count("payments_providercharge") > before["provider charges"],
                timeout=15,
                what="the provider to charge",
            )
            server.kill(doomed)
            charging.exception(timeout=30)  # the connection drops with the worker
    finally:
        server.thaw(other)
    wait_for(
        lambda: database.execute(
            "SELECT bool_and(locked_until < now()) FROM django_idempotency_idempotencykey "
            "WHERE state = 'in_progress'"
        )[0][0],
        timeout=LEASE + 10,
        what="the killed worker's lease to run out",
    )
    if sweep:
        manage(server.env, "idempotency_sweep")
    retry = server.post_json(CHARGES, CHARGE, key=second, timeout=30)
    after = database.effects()
    return {
        "provider charges": after["provider charges"] - before["provider charges"],
        "payments": after["payments"] - before["payments"],
        "retry": retry.status,
    }


def test_two_users_equal_keys_never_meet_at_the_provider(serve, database):
    server = serve()
    manage(
        server.env,
        "shell",
        "--verbosity",
        "0",
        "-c",
        "from django.contrib.auth.models import User; "
        "User.objects.filter(username='bob').exists() "
        "or User.objects.create_user('bob', password='password')",
    )
    bob = base64.b64encode(b"bob:password").decode()
    alice_answer = server.post_json(CHARGES, CHARGE, key="shared-key")
    bob_answer = server.post_json(
        CHARGES, CHARGE, key="shared-key", headers=[("Authorization", f"Basic {bob}")], auth=False
    )

    keys = database.execute("SELECT idempotency_key FROM payments_providercharge")
    assert (alice_answer.status, bob_answer.status) == (201, 201), f"{alice_answer} / {bob_answer}"
    assert alice_answer.field("id") != bob_answer.field("id")
    assert len({key for (key,) in keys}) == 2, keys
