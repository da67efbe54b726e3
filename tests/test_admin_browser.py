"""The admin in a real browser: headless Chromium, driven by Playwright, on a live server.

Needs Chromium at /usr/bin/chromium (Debian's package; .ci/run installs it). Skipped without it,
except in CI. With UPDATE_ADMIN_SCREENSHOTS=1 its screenshots replace the ones in docs/images.
It runs in the SQLite pass: the admin's queries are tested on both databases by test_admin.py,
and the live server this test needs outlives PostgreSQL's test database otherwise.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from django_idempotency.core.store import replay_counts
from django_idempotency.inbox.receiving import delivery_counts
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from django_idempotency.outbox import publish, relay
from django_idempotency.outbox import relaying as outbox_relaying
from tests.conftest import ApiClient
from tests.factories import IdempotencyKeyFactory, UserFactory
from tests.inbox import deliver, refund_event
from tests.testapp.models import Refund

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"

if os.environ.get("TEST_DATABASE", "sqlite") != "sqlite":
    pytest.skip("the browser test runs in the SQLite pass", allow_module_level=True)
if not Path(CHROMIUM).exists() and os.environ.get("CI", "").lower() != "true":
    pytest.skip("needs Chromium (Debian package chromium)", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")
# Waits for the page to show what is asserted: a click's navigation may not have finished yet.
expect = sync_api.expect
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def page(live_server):
    # Playwright's sync API runs an event loop; Django must allow its ORM calls meanwhile.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(15_000)
        yield page
        browser.close()
    os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)


UUID_KEY = "b5a91b5c-8f0e-4c53-9a57-31c2d1b0e7aa"


@pytest.fixture
def keys():
    alice = UserFactory(username="alice")
    client = ApiClient(alice)
    client.send("POST", "/payments/", {"amount": 1250, "currency": "EUR"}, key="pay-1250")
    client.send("POST", "/payments/", {"amount": 1250, "currency": "EUR"}, key="pay-1250")
    replay_counts.flush()  # what a timer thread does about a second later
    # A business 4xx is kept (a rejected request would not be).
    client.send("POST", "/payments/", {"amount": 5}, key="declined", headers={"X-Status": "402"})
    client.send("POST", "/payments/", {"amount": 70}, key="old-key")
    IdempotencyKey.objects.filter(key="old-key").update(
        expires_at=timezone.now() - timedelta(hours=1)
    )
    # A client library's key: a UUID, as most send.
    bob = ApiClient(UserFactory(username="bob"))
    bob.send("POST", "/payments/other-route/", {"amount": 990, "currency": "EUR"}, key=UUID_KEY)


def log_in(page, live_server):
    UserFactory(username="root", is_staff=True, is_superuser=True)
    page.goto(f"{live_server.url}/admin/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", "password")
    page.click("input[type=submit]")


@pytest.fixture
def images(tmp_path):
    return IMAGES if os.environ.get("UPDATE_ADMIN_SCREENSHOTS") else tmp_path


def rows(page):
    return page.locator("#result_list tbody tr")


def assert_every_column_fits(page):
    # The list scrolls sideways in its box when it does not fit.
    box = page.locator("#changelist .results")
    assert box.evaluate("box => box.scrollWidth <= box.clientWidth")
    assert page.evaluate("document.documentElement.scrollWidth") <= page.viewport_size["width"]


def test_the_key_list_fits_1366_pixels_and_finds_keys_by_prefix_user_and_route(
    page, live_server, keys, images
):
    log_in(page, live_server)
    changelist = f"{live_server.url}/admin/django_idempotency/idempotencykey/"
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto(changelist)
    expect(rows(page)).to_have_count(4)

    # Every column is in the window, and each key on one line, cut short but whole on hover.
    assert page.evaluate("document.documentElement.scrollWidth") <= 1366
    assert_every_column_fits(page)
    headers = page.locator("#result_list thead").inner_text().lower()
    assert "expires at" in headers
    assert "replay count" in headers
    cell = page.locator(f"#result_list .idempotency-id[title='{UUID_KEY}']")
    assert cell.inner_text() == "b5a91b5c-8f0e…"
    font = cell.evaluate("element => getComputedStyle(element).fontFamily")
    assert "mono" in font.lower(), font
    heights = {round(row.bounding_box()["height"]) for row in rows(page).all()}
    assert len(heights) == 1, heights  # no row wraps onto more lines than another
    page.screenshot(path=images / "admin-keys.png")

    # Who: the username, linked to the user's page.
    who = rows(page).filter(has_text="b5a91b5c").locator("td.field-who a")
    assert who.inner_text() == "bob"
    page.locator("#result_list").screenshot(path=images / "admin-keys-principal.png")
    who.click()
    expect(page.locator("#id_username")).to_have_value("bob")

    # The eight characters the demo prints find the key; the key's page shows it whole.
    page.goto(changelist)
    page.fill("#searchbar", "b5a91b5c")
    page.press("#searchbar", "Enter")
    expect(rows(page)).to_have_count(1)
    page.screenshot(path=images / "admin-keys-prefix-search.png")
    page.click("#result_list tbody tr th a")
    assert page.locator(".field-key .readonly").inner_text() == UUID_KEY
    assert page.locator(".field-who .readonly").inner_text() == "bob"

    # A username finds that user's keys; route: a route's.
    for term, count in [("alice", 3), ("bob", 1), ("route:payments/other-route/", 1)]:
        page.goto(changelist)
        page.fill("#searchbar", term)
        page.press("#searchbar", "Enter")
        expect(rows(page)).to_have_count(count)

    # Filter by expiry: expired; within an hour (none); today.
    page.goto(changelist)
    page.click("#changelist-filter >> text=Expired")
    expect(rows(page)).to_have_count(1)
    assert "old-key" in page.locator("#result_list").inner_text()
    page.click("#changelist-filter >> text=Within an hour")
    expect(rows(page)).to_have_count(0)


def test_the_key_list_fits_1366_pixels_with_long_principals_and_a_task_key(page, live_server):
    # What the example's demo leaves, and the longest names Django's user model takes.
    IdempotencyKeyFactory(
        scope="task:payments.tasks.send_receipt",
        method="TASK",
        route="payments.tasks.send_receipt",
        key="payment-17-receipt",
        completed=True,
    )
    IdempotencyKeyFactory(
        scope="task:payments.tasks.settle_marketplace_payouts_for_connected_accounts|tenant:acme",
        method="TASK",
        route="payments.tasks.settle_marketplace_payouts_for_connected_accounts",
        completed=True,
    )
    long_name = "accounts-payable-reconciliation@" + "finance." * 12 + "example.com"
    user = UserFactory(username=long_name[:150])
    IdempotencyKeyFactory(
        scope=f"auth.user:{user.pk} POST api/v1/organisations/<slug:organisation>/payments/",
        route="api/v1/organisations/<slug:organisation>/payments/<uuid:payment_id>/captures/",
        key=UUID_KEY,
        completed=True,
    )
    log_in(page, live_server)
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto(f"{live_server.url}/admin/django_idempotency/idempotencykey/")
    expect(rows(page)).to_have_count(3)

    assert_every_column_fits(page)
    who = page.locator("#result_list td.field-who")
    assert sorted(who.all_inner_texts()) == sorted(["task", long_name[:150], "tenant acme"])
    headers = page.locator("#result_list thead").inner_text().lower()
    assert "replay count" in headers
    # Cut short on screen, whole on hover.
    user_cell = page.locator(f"#result_list .idempotency-cut[title='auth.user:{user.pk}']")
    assert user_cell.evaluate("cell => cell.scrollWidth > cell.clientWidth")
    last = page.locator("#result_list thead th").last.bounding_box()
    assert last["x"] + last["width"] <= 1366


def test_an_operator_finds_a_key_reads_its_response_and_cleans_up(page, live_server, keys, images):
    log_in(page, live_server)
    changelist = f"{live_server.url}/admin/django_idempotency/idempotencykey/"
    page.goto(changelist)
    expect(rows(page)).to_have_count(4)

    # Search by the exact key, open it, read the stored response.
    page.fill("#searchbar", "pay-1250")
    page.press("#searchbar", "Enter")
    expect(rows(page)).to_have_count(1)
    page.click("#result_list tbody tr th a")
    body = page.locator(".field-stored_body").inner_text()
    assert '"amount": 1250' in body
    assert "Location" not in body  # headers are in their own table
    headers = page.locator(".field-stored_headers table").inner_text()
    assert "Content-Type\tapplication/json" in headers
    assert "Location\t/payments/" in headers
    assert page.locator(".field-replay_count").inner_text().strip().endswith("1")
    assert page.locator("input[name=_save]").count() == 0  # nothing is editable
    page.screenshot(path=images / "admin-key.png", full_page=True)

    # A stuck lease: its request died. Release it.
    IdempotencyKey.objects.filter(key="pay-1250").update(
        state="in_progress", locked_until=timezone.now() - timedelta(minutes=1)
    )
    page.goto(f"{changelist}?lease=expired")
    page.check("#action-toggle")
    page.select_option("select[name=action]", "release_expired_leases")
    page.click("button[name=index]")
    assert "Released 1 expired leases" in page.locator(".messagelist").inner_text()
    released = IdempotencyKey.objects.get(key="pay-1250")
    assert (released.state, released.locked_until, released.lease_version) == ("failed", None, 2)

    # Delete what has expired: the live keys are kept.
    page.goto(changelist)
    page.check("#action-toggle")
    page.select_option("select[name=action]", "delete_expired")
    page.click("button[name=index]")
    assert "Deleted 1 expired keys" in page.locator(".messagelist").inner_text()
    assert set(IdempotencyKey.objects.values_list("key", flat=True)) == {
        "pay-1250",
        "declined",
        UUID_KEY,
    }

    # Or purge every expired key at once, with the button above the list.
    IdempotencyKey.objects.filter(key="declined").update(
        expires_at=timezone.now() - timedelta(hours=1)
    )
    page.click("#purge-expired")
    assert "Purged 1 expired keys." in page.locator(".messagelist").inner_text()
    assert set(IdempotencyKey.objects.values_list("key", flat=True)) == {"pay-1250", UUID_KEY}


@pytest.fixture
def inbox_events():
    deliver(refund_event("evt_refund_ok", amount=1250), headers={"User-Agent": "provider/2"})
    # The sender did not see the answer in time, and delivered it twice more.
    deliver(refund_event("evt_refund_ok", amount=1250), headers={"User-Agent": "provider/2"})
    deliver(refund_event("evt_refund_ok", amount=1250), headers={"User-Agent": "provider/2"})
    deliver(refund_event("evt_refund_retrying", fail_times=5))
    deliver(refund_event("evt_refund_dead", fail="always"))
    delivery_counts.flush()  # what a timer thread does about a second later
    InboxEvent.objects.filter(event_id="evt_refund_dead").update(
        status="dead", next_attempt_at=None
    )
    # Paths relative to the checkout, as a reader of the screenshots would know them.
    root = f"{Path(__file__).resolve().parent.parent}/"
    for event in InboxEvent.objects.exclude(last_traceback=""):
        event.last_traceback = event.last_traceback.replace(root, "")
        event.save(update_fields=["last_traceback"])


def test_an_operator_finds_a_dead_event_reads_why_and_reprocesses_it(
    page, live_server, inbox_events, images
):
    log_in(page, live_server)
    changelist = f"{live_server.url}/admin/django_idempotency/inboxevent/"
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto(changelist)
    expect(page.locator("#result_list tbody tr")).to_have_count(3)
    page.screenshot(path=images / "admin-inbox.png")
    assert_every_column_fits(page)
    ok = page.locator("#result_list tbody tr", has_text="evt_refund_ok")
    assert ok.locator("td.field-deliveries").inner_text() == "3"
    assert ok.locator("td.field-last_delivered_at").inner_text() != "—"
    dead = page.locator("#result_list tbody tr", has_text="evt_refund_dead")
    assert dead.locator("td.field-deliveries").inner_text() == "1"
    assert dead.locator("td.field-last_delivered_at").inner_text() == "—"
    page.screenshot(path=images / "admin-inbox.png")

    # The processed event: delivered three times, processed once, no error.
    page.click("#result_list tbody tr >> text=evt_refund_ok")
    assert page.locator(".field-deliveries .readonly").inner_text() == "3"
    assert page.locator(".field-error .readonly").inner_text() == "—"
    assert page.locator(".field-traceback .readonly").inner_text() == "—"
    page.goto(changelist)

    # Filter: dead events only; open the one there is.
    page.click("#changelist-filter >> text=dead")
    expect(page.locator("#result_list tbody tr")).to_have_count(1)
    page.click("#result_list tbody tr th a")
    assert '"fail": "always"' in page.locator(".field-pretty_payload").inner_text()
    assert "the ledger is unavailable" in page.locator(".field-error").inner_text()
    assert "Traceback" in page.locator(".field-traceback").inner_text()
    assert page.locator("input[name=_save]").count() == 0  # nothing is editable
    page.screenshot(path=images / "admin-inbox-event.png", full_page=True)

    # The fix: the event no longer asks the handler to fail. Reprocess it from the list.
    InboxEvent.objects.filter(event_id="evt_refund_dead").update(
        payload=refund_event("evt_refund_dead", amount=300)
    )
    page.goto(f"{changelist}?status__exact=dead")
    page.check("#action-toggle")
    page.select_option("select[name=action]", "reprocess")
    page.click("button[name=index]")
    assert "Reprocessed 1 of the 1 selected events." in page.locator(".messagelist").inner_text()
    assert InboxEvent.objects.get(event_id="evt_refund_dead").status == "processed"
    assert list(
        Refund.objects.filter(event_id="evt_refund_dead").values_list("amount", flat=True)
    ) == [300]

    # The failing one: retry it now, then give up on it.
    for action, message in [
        ("retry_now", "Retried 1 of the 1 selected events."),
        ("mark_dead", "Marked dead 1 of the 1 selected events."),
    ]:
        page.goto(f"{changelist}?q=evt_refund_retrying")
        page.check("#action-toggle")
        page.select_option("select[name=action]", action)
        page.click("button[name=index]")
        assert message in page.locator(".messagelist").inner_text()
    retrying = InboxEvent.objects.get(event_id="evt_refund_retrying")
    assert (retrying.status, retrying.attempts) == ("dead", 2)


@pytest.fixture
def outbox_messages(monkeypatch):
    monkeypatch.setattr(outbox_relaying, "trigger", lambda: None)
    publish("tests.recorded", {"payment": 41, "amount": 1250}, ordering_key="payment-41")
    dead = publish("tests.failing", {"payment": 42, "fail_times": "always"})
    relay()
    OutboxMessage.objects.filter(pk=dead.pk).update(
        status="dead",
        next_attempt_at=None,
        attempts=10,
        last_error="ConnectionError: the consumer is down (attempt 10)",
    )
    monkeypatch.undo()


def test_an_operator_redelivers_a_dead_outbox_message(page, live_server, outbox_messages, images):
    log_in(page, live_server)
    changelist = f"{live_server.url}/admin/django_idempotency/outboxmessage/"
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto(changelist)
    expect(page.locator("#result_list tbody tr")).to_have_count(2)
    assert_every_column_fits(page)
    page.screenshot(path=images / "admin-outbox.png")

    page.click("#changelist-filter >> text=dead")
    page.click("#result_list tbody tr th a")
    assert "ConnectionError: the consumer is down" in page.locator(".field-error").inner_text()
    assert '"payment": 42' in page.locator(".field-pretty_payload").inner_text()
    page.screenshot(path=images / "admin-outbox-message.png", full_page=True)

    # The consumer is back.
    OutboxMessage.objects.filter(status="dead").update(payload={"payment": 42})
    page.goto(f"{changelist}?status__exact=dead")
    page.check("#action-toggle")
    page.select_option("select[name=action]", "redeliver")
    page.click("button[name=index]")
    assert "Redelivered 1 of the 1 selected messages." in page.locator(".messagelist").inner_text()
    assert not OutboxMessage.objects.exclude(status="dispatched").exists()
