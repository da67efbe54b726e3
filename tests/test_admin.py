"""The admin: read-only pages, filters, search, and actions that are logged."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency.admin import keys as key_admin
from django_idempotency.inbox.receiving import delivery_counts
from django_idempotency.models import IdempotencyKey, InboxEvent, OutboxMessage
from tests.conftest import POSTGRESQL
from tests.factories import (
    IdempotencyKeyFactory,
    InboxEventFactory,
    OutboxMessageFactory,
    UserFactory,
)
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


def shown_keys(admin_client, **params):
    return sorted(key.key for key in admin_client.get(CHANGELIST, params).context["cl"].result_list)


def test_the_expiry_filter_offers_ranges_that_fit_keys_that_expire_later(admin_client, stored):
    IdempotencyKeyFactory(key="in-half-an-hour", created_at=timezone.now() - timedelta(hours=23.5))
    IdempotencyKeyFactory(key="in-six-days", expires_at=timezone.now() + timedelta(days=6))
    cl = admin_client.get(CHANGELIST).context["cl"]
    spec = next(
        spec for spec in cl.filter_specs if getattr(spec, "parameter_name", "") == "expires"
    )
    assert [title for _value, title in spec.lookup_choices] == [
        "Expired",
        "Within an hour",
        "Today",
        "This week",
    ]
    now = timezone.localtime()
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    next_monday = tomorrow + timedelta(days=6 - now.weekday())
    expiries = dict(IdempotencyKey.objects.values_list("key", "expires_at"))

    def expiring_by(until):
        return sorted(key for key, expires in expiries.items() if now < expires <= until)

    assert shown_keys(admin_client, expires="expired") == ["old-key"]
    assert shown_keys(admin_client, expires="hour") == ["in-half-an-hour"]
    assert shown_keys(admin_client, expires="today") == expiring_by(tomorrow)
    assert shown_keys(admin_client, expires="week") == expiring_by(next_monday)
    assert "in-half-an-hour" in expiring_by(tomorrow) or now.hour == 23
    assert len(shown_keys(admin_client)) == 5


def test_search_by_the_first_characters_of_a_key_case_sensitively(admin_client, stored):
    IdempotencyKeyFactory(key="b5a91b5c-8f0e-4c53-9a57-31c2d1b0e7aa")
    IdempotencyKeyFactory(key="b5a91b5d-0000-4000-8000-000000000000")

    assert shown_keys(admin_client, q="live-key") == ["live-key"]
    assert shown_keys(admin_client, q="live") == ["live-key"]
    assert shown_keys(admin_client, q="LIVE") == []
    assert shown_keys(admin_client, q=" b5a91b5c ") == ["b5a91b5c-8f0e-4c53-9a57-31c2d1b0e7aa"]
    assert len(shown_keys(admin_client, q="b5a91b5")) == 2
    # "%" and "_" are no wildcards; characters no key may hold match nothing.
    assert shown_keys(admin_client, q="l%") == shown_keys(admin_client, q="liv_") == []
    assert shown_keys(admin_client, q="li ve") == shown_keys(admin_client, q="clé") == []


def test_search_by_username_and_by_route(admin_client, stored, client_bob):
    client_bob.send("POST", "/payments/other-route/", {"amount": 3}, key="bobs-key")

    assert shown_keys(admin_client, q="alice") == ["live-key"]
    assert shown_keys(admin_client, q="bob") == ["bobs-key"]
    assert shown_keys(admin_client, q="route:payments/other") == ["bobs-key"]
    assert shown_keys(admin_client, q="route:/payments/other-route/") == ["bobs-key"]
    assert len(shown_keys(admin_client, q="route:payments/")) == 4
    assert shown_keys(admin_client, q="route:refunds/") == []


def test_the_list_shows_a_short_key_in_full_on_hover_and_the_principal_by_name(
    admin_client, stored, alice
):
    long_key = "b5a91b5c-8f0e-4c53-9a57-31c2d1b0e7aa"
    IdempotencyKeyFactory(key=long_key, scope=f"auth.user:{alice.pk} POST payments/")
    IdempotencyKeyFactory(key="anonymous-key", scope="anonymous POST payments/")
    IdempotencyKeyFactory(key="gone-key", scope="auth.user:999999 POST payments/")

    page = admin_client.get(CHANGELIST).content.decode()

    assert f'<span class="idempotency-id" title="{long_key}">b5a91b5c-8f0e…</span>' in page
    assert '<span class="idempotency-id" title="live-key">live-key</span>' in page
    user_page = f"/admin/auth/user/{alice.pk}/change/"
    alice_cell = f'<span class="idempotency-cut" title="auth.user:{alice.pk}">alice</span>'
    assert page.count(f'<a href="{user_page}">{alice_cell}</a>') == 2
    assert "auth.user:999999" in page  # a deleted user is named as the scope names it
    assert "anonymous" in page
    assert "POST payments/" in page
    for column in ("Expires at", "Replay count", "Who"):
        assert column in page


def test_the_principals_of_a_page_are_read_in_one_query(admin_client, stored):
    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get(CHANGELIST).status_code == 200
        return len(captured)

    one_user = queries()
    for n in range(5):
        user = UserFactory(username=f"customer{n}")
        IdempotencyKeyFactory(scope=f"auth.user:{user.pk} POST payments/")

    assert queries() == one_user


def test_the_principal_is_not_linked_for_a_user_who_may_not_view_users(client, stored, alice):
    viewer = UserFactory(username="viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencykey"))
    client.force_login(viewer)

    page = client.get(CHANGELIST).content.decode()

    assert "alice" in page
    assert f"/admin/auth/user/{alice.pk}/change/" not in page


def test_the_key_page_names_the_principal(admin_client, stored, alice):
    page = admin_client.get(f"{CHANGELIST}{stored.pk}/change/").content.decode()

    user_page = f"/admin/auth/user/{alice.pk}/change/"
    alice_cell = f'<span class="idempotency-cut" title="auth.user:{alice.pk}">alice</span>'
    assert f'<a href="{user_page}">{alice_cell}</a>' in page
    assert f"auth.user:{alice.pk} POST payments/" in page  # and the scope in full


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
def test_the_inbox_shows_how_often_an_event_was_delivered_and_when_last(admin_client, events):
    deliver(refund_event("evt_ok", amount=42))
    deliver(refund_event("evt_ok", amount=42))
    delivery_counts.flush()  # what a timer thread does about a second later
    ok = InboxEvent.objects.get(event_id="evt_ok")

    listed = {
        event.event_id: event.deliveries
        for event in admin_client.get(INBOX).context["cl"].result_list
    }
    page = admin_client.get(f"{INBOX}{ok.pk}/change/").content.decode()

    assert listed == {"evt_ok": 3, "evt_failed": 1, "evt_dead": 1}
    assert "Deliveries" in admin_client.get(INBOX).content.decode()
    assert ok.last_delivered_at > ok.received_at
    assert "Last delivered at" in page
    # No error: a dash, as for the traceback.
    assert '<div class="readonly">—</div>' in page
    assert '<div class="readonly">-</div>' not in page


@pytest.mark.django_db(transaction=True)
def test_the_inbox_shows_an_event_delivered_again_with_another_payload(admin_client, events):
    answer = deliver(refund_event("evt_ok", amount=4200))
    ok = InboxEvent.objects.get(event_id="evt_ok")

    def shown(**params):
        return [
            event.event_id for event in admin_client.get(INBOX, params).context["cl"].result_list
        ]

    page = admin_client.get(f"{INBOX}{ok.pk}/change/").content.decode()
    failed = admin_client.get(f"{INBOX}{events['evt_failed'].pk}/change/").content.decode()

    assert answer.status_code == 409
    assert (ok.conflicts, ok.conflicting_payload["data"]["amount"]) == (1, 4200)
    assert ok.payload["data"]["amount"] == 42  # the first payload stays
    assert shown(conflict="yes") == ["evt_ok"]
    assert "Conflicting payload" in page
    assert "&quot;amount&quot;: 4200" in page
    assert ok.conflicting_payload_hash in page
    assert "Conflicting payload" not in failed  # no conflict, no section


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


# A NUL character: PostgreSQL refuses it in text, so no stored value holds one.

NUL = "\x00"


@pytest.mark.parametrize(
    ("model", "query"),
    [
        # Django's filters, a lookup the page allows, the library's own filters, the search box
        # in each of its forms, the ordering, and a parameter's name.
        *(
            ("idempotencykey", f"{name}=%00")
            for name in ("state", "state__exact", "key__startswith", "method", "expires")
        ),
        *(("idempotencykey", f"{name}=%00") for name in ("lease", "attention", "o")),
        *(("idempotencykey", f"q={term}") for term in ("%00", "key%00", "route:%00")),
        ("idempotencykey", "%00=x"),
        *(
            ("inboxevent", f"{name}=%00")
            for name in ("status", "status__exact", "source", "source__exact", "q")
        ),
        *(("inboxevent", f"{name}=%00") for name in ("event_type", "event_type__exact")),
        *(("outboxmessage", f"{name}=%00") for name in ("topic", "topic__exact", "status", "q")),
    ],
)
def test_a_nul_character_in_a_list_parameter_is_an_invalid_lookup(admin_client, model, query):
    IdempotencyKeyFactory(completed=True)
    InboxEventFactory(failed=True)
    OutboxMessageFactory(sent=True)
    page = f"/admin/django_idempotency/{model}/"

    response = admin_client.get(f"{page}?{query}")

    # What the admin answers to any lookup it cannot make: the list again, without its filters,
    # here with the message Django's search box gives.
    assert (response.status_code, response.get("Location")) == (302, f"{page}?e=1")
    again = admin_client.get(response["Location"])
    assert again.status_code == 200
    assert "Null characters are not allowed." in again.content.decode()


def test_an_action_on_a_list_filtered_by_a_nul_character_changes_nothing(admin_client, stored):
    expired = IdempotencyKey.objects.get(key="old-key")

    response = admin_client.post(
        f"{CHANGELIST}?state=%00",
        {"action": "delete_expired", "_selected_action": [expired.pk]},
    )

    assert (response.status_code, response["Location"]) == (302, f"{CHANGELIST}?e=1")
    assert IdempotencyKey.objects.filter(pk=expired.pk).exists()
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize(
    ("model", "action"),
    [
        ("idempotencykey", "release_expired_leases"),
        ("idempotencykey", "delete_expired"),
        ("inboxevent", "reprocess"),
        ("inboxevent", "retry_now"),
        ("inboxevent", "mark_dead"),
        ("outboxmessage", "redeliver"),
    ],
)
@pytest.mark.parametrize("selected", ["abc", NUL, str(2**70)])
def test_an_action_on_rows_selected_by_ids_that_no_row_can_have_changes_nothing(
    admin_client, model, action, selected
):
    IdempotencyKeyFactory(lease_expired=True, expired=True)
    InboxEventFactory(failed=True)
    OutboxMessageFactory(dead=True)
    page = f"/admin/django_idempotency/{model}/"
    tables = (IdempotencyKey, InboxEvent, OutboxMessage)
    before = [list(table.objects.values()) for table in tables]

    response = admin_client.post(page, {"action": action, "_selected_action": [selected]})

    # As when nothing is selected: the list again, with Django's message.
    assert (response.status_code, response["Location"]) == (302, page)
    assert "Items must be selected" in admin_client.get(page).content.decode()
    assert [list(table.objects.values()) for table in tables] == before
    assert not LogEntry.objects.exists()


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
    monkeypatch.setattr(key_admin, "PURGE_SECONDS", 0)

    response = admin_client.post(f"{CHANGELIST}purge-expired/", follow=True)

    assert "Time ran out" in response.content.decode()


@pytest.mark.server_db
# MariaDB's ANALYZE TABLE commits the test's transaction: the table must be emptied afterwards.
@pytest.mark.django_db(transaction=True)
def test_a_key_prefix_search_reads_an_index_not_the_table(rf):
    import uuid  # noqa: PLC0415

    from django.contrib import admin  # noqa: PLC0415

    keys = [str(uuid.uuid4()) for _ in range(5000)]
    IdempotencyKey.objects.bulk_create(
        IdempotencyKeyFactory.build(key=key, scope=f"auth.user:{n % 50} POST payments/")
        for n, key in enumerate(keys)
    )
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {'' if POSTGRESQL else 'TABLE '}django_idempotency_idempotencykey")
    model_admin = admin.site._registry[IdempotencyKey]
    found, _ = model_admin.get_search_results(
        rf.get("/"), IdempotencyKey.objects.order_by("-id"), keys[1234][:8]
    )

    assert keys[1234] in [key.key for key in found[:50]]
    # The page, and the capped count of the paginator.
    for query in (found[:50], found[:10_000].values("pk")):
        plan = query.explain()
        # MariaDB compares keys byte for byte: the unique index, which the key leads, serves a
        # range. PostgreSQL's collation-aware btree cannot: it has an index of its own.
        index = "idempotency_key_prefix_idx" if POSTGRESQL else "idempotency_scope_key_uniq"
        assert index in plan, plan
        assert "Seq Scan" not in plan, plan
