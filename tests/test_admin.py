"""The admin: read-only pages, filters, search, and actions that are logged."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission

from django_idempotency import admin as admin_module
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from tests.factories import IdempotencyKeyFactory, OutboxMessageFactory, UserFactory
from tests.inbox import deliver, refund_event
from tests.testapp import outbox as test_outbox
from tests.testapp.models import Refund

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/django_idempotency/idempotencykey/"


@pytest.fixture
def admin_client(client):
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    return client


@pytest.fixture
def stored(client_alice):
    """A completed key with a JSON response, an expired key and a key with a binary body."""
    client_alice.send("POST", "/payments/", {"amount": 1250}, key="live-key")
    IdempotencyKeyFactory(key="old-key", completed=True, expired=True)
    IdempotencyKeyFactory(
        key="binary-key",
        completed=True,
        response_headers=[["Content-Type", "application/pdf"]],
        response_body=b"%PDF-" + bytes(2000),
    )
    return IdempotencyKey.objects.get(key="live-key")


def test_the_changelist_shows_keys_without_counting_them_all(admin_client, stored):
    response = admin_client.get(CHANGELIST)
    assert response.status_code == 200
    page = response.content.decode()
    for key in ("live-key", "old-key", "binary-key"):
        assert key in page
    assert response.context["cl"].show_full_result_count is False


def test_the_expired_filter(admin_client, stored):
    expired = admin_client.get(CHANGELIST, {"expired": "yes"}).context["cl"].result_list
    assert [key.key for key in expired] == ["old-key"]


def test_search_is_by_exact_key(admin_client, stored):
    assert [
        k.key for k in admin_client.get(CHANGELIST, {"q": "live-key"}).context["cl"].result_list
    ] == ["live-key"]
    assert list(admin_client.get(CHANGELIST, {"q": "live"}).context["cl"].result_list) == []
    assert list(admin_client.get(CHANGELIST, {"q": "LIVE-KEY"}).context["cl"].result_list) == []


def test_the_detail_page_shows_the_stored_response_pretty(admin_client, stored):
    page = admin_client.get(f"{CHANGELIST}{stored.pk}/change/").content.decode()
    assert "&quot;amount&quot;: 1250" in page  # indented JSON, escaped
    assert "<th>Location</th>" in page
    assert stored.fingerprint in page
    assert 'name="_save"' not in page  # nothing can be edited


def test_a_binary_body_is_summarised(admin_client, stored):
    binary = IdempotencyKey.objects.get(key="binary-key")
    page = admin_client.get(f"{CHANGELIST}{binary.pk}/change/").content.decode()
    assert "application/pdf (2,005 bytes)" in page


def test_no_key_can_be_added(admin_client, stored):
    assert admin_client.get(f"{CHANGELIST}add/").status_code == 403


def test_only_expired_keys_can_be_deleted(admin_client, stored):
    live_delete = admin_client.get(f"{CHANGELIST}{stored.pk}/delete/")
    assert live_delete.status_code == 403
    expired = IdempotencyKey.objects.get(key="old-key")
    assert admin_client.get(f"{CHANGELIST}{expired.pk}/delete/").status_code == 200


def test_the_action_deletes_the_selected_expired_keys_and_logs_it(admin_client, stored):
    everything = list(IdempotencyKey.objects.values_list("pk", flat=True))
    response = admin_client.post(
        CHANGELIST, {"action": "delete_expired", "_selected_action": everything}, follow=True
    )
    assert "Deleted 1 expired keys" in response.content.decode()
    assert set(IdempotencyKey.objects.values_list("key", flat=True)) == {"live-key", "binary-key"}
    assert LogEntry.objects.filter(action_flag=DELETION, object_repr__startswith="old-key").exists()
    actions = admin_client.get(CHANGELIST).context["action_form"].fields["action"].choices
    assert "delete_selected" not in dict(actions)


def test_a_user_who_may_only_view_sees_no_actions(client, stored):
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencykey"))
    client.force_login(viewer)
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    assert response.context["action_form"] is None or not [
        name for name, _ in response.context["action_form"].fields["action"].choices if name
    ]


def test_keys_without_a_response_or_with_text_or_broken_json(admin_client, stored):
    IdempotencyKeyFactory(key="pending-key")
    IdempotencyKeyFactory(
        key="text-key",
        completed=True,
        response_headers=[["Content-Type", "text/plain"]],
        response_body=b"plain <b>",
    )
    IdempotencyKeyFactory(key="broken-key", completed=True, response_body=b"{not json")

    def page(key):
        pk = IdempotencyKey.objects.get(key=key).pk
        return admin_client.get(f"{CHANGELIST}{pk}/change/").content.decode()

    assert page("pending-key").count("—") >= 2
    assert "plain &lt;b&gt;" in page("text-key")
    assert "application/json (9 bytes)" in page("broken-key")


def test_stuck_leases_are_found_and_released(admin_client, stored):
    IdempotencyKeyFactory(key="stuck-key", lease_expired=True)
    IdempotencyKeyFactory(key="held-key", leased=True)

    found = admin_client.get(CHANGELIST, {"lease": "expired"}).context["cl"].result_list
    assert [key.key for key in found] == ["stuck-key"]
    both = list(
        IdempotencyKey.objects.filter(key__in=["stuck-key", "held-key"]).values_list(
            "pk", flat=True
        )
    )
    response = admin_client.post(
        CHANGELIST, {"action": "release_expired_leases", "_selected_action": both}, follow=True
    )
    assert "Released 1 expired leases" in response.content.decode()
    released = IdempotencyKey.objects.get(key="stuck-key")
    assert (released.state, released.locked_until, released.lease_version) == ("failed", None, 2)
    assert IdempotencyKey.objects.get(key="held-key").state == IdempotencyKey.State.IN_PROGRESS


def test_the_method_filter_and_the_capped_count(admin_client, stored):
    from django_idempotency.admin import CappedPaginator  # noqa: PLC0415

    posts = admin_client.get(CHANGELIST, {"method": "POST"}).context["cl"]
    assert posts.result_count == 3
    assert admin_client.get(CHANGELIST, {"method": "DELETE"}).context["cl"].result_count == 0
    assert CappedPaginator(IdempotencyKey.objects.order_by("pk"), 1).count == 3
    CappedPaginator.CAP = 2
    try:
        assert CappedPaginator(IdempotencyKey.objects.order_by("pk"), 1).count == 2
    finally:
        CappedPaginator.CAP = 10_000


# Inbox events.

INBOX = "/admin/django_idempotency/inboxevent/"


@pytest.fixture
def events():
    """A processed event, a failed one and a dead one, delivered over HTTP."""
    deliver(refund_event("evt_ok", amount=42), headers={"User-Agent": "provider/2"})
    deliver(refund_event("evt_failed", fail_times=5))
    deliver(refund_event("evt_dead", fail="always"))
    InboxEvent.objects.filter(event_id="evt_dead").update(status="dead", next_attempt_at=None)
    return {event.event_id: event for event in InboxEvent.objects.all()}


@pytest.mark.django_db(transaction=True)
def test_the_inbox_changelist_filters_by_status_and_searches_by_exact_event_id(
    admin_client, events
):
    def shown(**params):
        result = admin_client.get(INBOX, params).context["cl"].result_list
        return sorted(event.event_id for event in result)

    assert shown() == ["evt_dead", "evt_failed", "evt_ok"]
    assert shown(status__exact="failed") == ["evt_failed"]
    assert shown(source__exact="tests", event_type__exact="refund.succeeded") == shown()
    assert shown(q="evt_ok") == ["evt_ok"]
    assert shown(q="evt") == []


@pytest.mark.django_db(transaction=True)
def test_the_inbox_detail_page_shows_the_payload_headers_and_error(admin_client, events):
    ok = admin_client.get(f"{INBOX}{events['evt_ok'].pk}/change/").content.decode()
    failed = admin_client.get(f"{INBOX}{events['evt_failed'].pk}/change/").content.decode()

    assert "&quot;amount&quot;: 42" in ok  # indented JSON, escaped
    assert "<th>User-Agent</th><td>provider/2</td>" in ok
    assert 'name="_save"' not in ok
    assert "RuntimeError: the ledger is unavailable (attempt 1)" in failed
    assert "Traceback (most recent call last)" in failed


@pytest.mark.django_db(transaction=True)
def test_inbox_events_cannot_be_added_or_deleted(admin_client, events):
    assert admin_client.get(f"{INBOX}add/").status_code == 403
    assert admin_client.get(f"{INBOX}{events['evt_dead'].pk}/delete/").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_reprocess_runs_a_dead_event_again_and_logs_it(admin_client, events):
    dead = events["evt_dead"]
    # The fix: the event no longer asks the handler to fail.
    InboxEvent.objects.filter(pk=dead.pk).update(payload=refund_event("evt_dead"))

    response = admin_client.post(
        INBOX, {"action": "reprocess", "_selected_action": [dead.pk]}, follow=True
    )

    assert "Reprocessed 1 of the 1 selected events." in response.content.decode()
    dead.refresh_from_db()
    assert (dead.status, dead.attempts) == ("processed", 1)
    assert Refund.objects.filter(event_id="evt_dead").count() == 1
    log = LogEntry.objects.get(object_id=str(dead.pk))
    assert (log.action_flag, log.change_message) == (CHANGE, "Reprocessed")


@pytest.mark.django_db(transaction=True)
def test_retry_now_and_mark_dead(admin_client, events):
    everything = [event.pk for event in events.values()]

    response = admin_client.post(
        INBOX, {"action": "retry_now", "_selected_action": everything}, follow=True
    )
    assert "Retried 1 of the 3 selected events." in response.content.decode()
    assert InboxEvent.objects.get(event_id="evt_failed").attempts == 2

    response = admin_client.post(
        INBOX, {"action": "mark_dead", "_selected_action": everything}, follow=True
    )
    assert "Marked dead 1 of the 3 selected events." in response.content.decode()
    statuses = dict(InboxEvent.objects.values_list("event_id", "status"))
    assert statuses == {"evt_ok": "processed", "evt_failed": "dead", "evt_dead": "dead"}
    assert LogEntry.objects.filter(action_flag=CHANGE).count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_user_who_may_only_view_inbox_events_sees_no_actions(client, events):
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_inboxevent"))
    client.force_login(viewer)

    response = client.get(INBOX)

    assert response.status_code == 200
    assert response.context["action_form"] is None
    client.post(INBOX, {"action": "reprocess", "_selected_action": [events["evt_dead"].pk]})
    assert InboxEvent.objects.get(event_id="evt_dead").status == "dead"


# Outbox messages.

OUTBOX = "/admin/django_idempotency/outboxmessage/"


@pytest.fixture
def outbox_messages():
    """A dispatched message and a dead one."""
    sent = OutboxMessageFactory(
        topic="tests.recorded", payload={"amount": 42}, headers={"X-Tenant": "acme"}, sent=True
    )
    dead = OutboxMessageFactory(
        topic="tests.failing",
        payload={"fail_times": "always"},
        dead=True,
        attempts=10,
        last_error="ConnectionError: down",
    )
    return {"sent": sent, "dead": dead}


@pytest.mark.django_db(transaction=True)
def test_the_outbox_changelist_filters_and_searches_by_exact_message_id(
    admin_client, outbox_messages
):
    def shown(**params):
        result = admin_client.get(OUTBOX, params).context["cl"].result_list
        return sorted(message.topic for message in result)

    assert shown() == ["tests.failing", "tests.recorded"]
    assert shown(status__exact="dead") == ["tests.failing"]
    assert shown(q=str(outbox_messages["sent"].message_id)) == ["tests.recorded"]
    assert shown(q="not-a-uuid") == []


@pytest.mark.django_db(transaction=True)
def test_the_outbox_detail_page_shows_the_payload_headers_and_error(admin_client, outbox_messages):
    sent = admin_client.get(f"{OUTBOX}{outbox_messages['sent'].pk}/change/").content.decode()
    dead = admin_client.get(f"{OUTBOX}{outbox_messages['dead'].pk}/change/").content.decode()

    assert "&quot;amount&quot;: 42" in sent
    assert "<th>X-Tenant</th><td>acme</td>" in sent
    assert 'name="_save"' not in sent
    assert "ConnectionError: down" in dead
    assert admin_client.get(f"{OUTBOX}add/").status_code == 403
    assert admin_client.get(f"{OUTBOX}{outbox_messages['dead'].pk}/delete/").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_redeliver_sends_a_dead_message_again_with_its_id_and_logs_it(
    admin_client, outbox_messages
):
    dead = outbox_messages["dead"]
    OutboxMessage.objects.filter(pk=dead.pk).update(payload={})  # the consumer is back

    response = admin_client.post(
        OUTBOX, {"action": "redeliver", "_selected_action": [dead.pk]}, follow=True
    )

    assert "Redelivered 1 of the 1 selected messages." in response.content.decode()
    dead.refresh_from_db()
    assert (dead.status, dead.attempts) == ("dispatched", 1)
    assert test_outbox.RECORDED[-1] == str(dead.message_id)
    log = LogEntry.objects.get(object_id=str(dead.pk))
    assert (log.action_flag, log.change_message) == (CHANGE, "Redelivered")


@pytest.mark.django_db(transaction=True)
def test_a_user_who_may_only_view_outbox_messages_sees_no_actions(client, outbox_messages):
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_outboxmessage"))
    client.force_login(viewer)

    assert client.get(OUTBOX).context["action_form"] is None


def test_purge_all_expired_keys_from_the_changelist_and_log_it(admin_client, stored):
    page = admin_client.get(CHANGELIST).content.decode()
    assert 'id="purge-expired"' in page

    response = admin_client.post(f"{CHANGELIST}purge-expired/", follow=True)

    assert "Purged 1 expired keys." in response.content.decode()
    assert set(IdempotencyKey.objects.values_list("key", flat=True)) == {"live-key", "binary-key"}
    log = LogEntry.objects.get(action_flag=DELETION)
    assert log.change_message == "Purged 1 expired keys."
    assert admin_client.get(f"{CHANGELIST}purge-expired/").status_code == 405


def test_purge_all_expired_needs_the_delete_permission(client, stored):
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencykey"))
    client.force_login(viewer)

    assert 'id="purge-expired"' not in client.get(CHANGELIST).content.decode()
    assert client.post(f"{CHANGELIST}purge-expired/").status_code == 403
    assert IdempotencyKey.objects.filter(key="old-key").exists()


def test_a_purge_cut_short_by_its_time_limit_says_so(admin_client, stored, monkeypatch):
    monkeypatch.setattr(admin_module, "PURGE_SECONDS", 0)

    response = admin_client.post(f"{CHANGELIST}purge-expired/", follow=True)

    assert "Time ran out" in response.content.decode()


def test_the_expiry_date_filter_narrows_the_list(admin_client, stored):
    cl = admin_client.get(CHANGELIST).context["cl"]
    spec = next(spec for spec in cl.filter_specs if getattr(spec, "field_path", "") == "expires_at")
    past_week = dict(spec.links)["Past 7 days"]

    shown = admin_client.get(CHANGELIST, past_week).context["cl"].result_list

    # Up to midnight tonight: the key that expired an hour ago, not those that expire tomorrow.
    assert [key.key for key in shown] == ["old-key"]
