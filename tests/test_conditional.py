"""Conditional updates: ETag, If-Match and If-None-Match, on DRF and plain views."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory

from django_idempotency.decorators import conditional
from tests.conftest import ApiClient
from tests.test_store import in_threads
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db

VERSIONED = "/documents/{}/"
BY_CONTENT = "/documents/{}/by-content/"
STRICT = "/documents/{}/strict/"
IDEMPOTENT = "/documents/{}/idempotent/"
PLAIN = "/plain-documents/{}/"
PLAIN_BY_CONTENT = "/plain-documents/{}/by-content/"
PLAIN_IDEMPOTENT = "/plain-documents/{}/idempotent/"


@pytest.fixture
def document(db):
    return Document.objects.create(title="draft", body="text")


def patch(client, url, data, *, if_match=None, key=None, **headers):
    if if_match is not None:
        headers["If-Match"] = if_match
    return client.send("PATCH", url, data, key=key, headers=headers)


def assert_problem(response, status, code):
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == code


def test_get_gives_the_version_as_a_strong_etag_and_304_when_it_matches(client_alice, document):
    url = VERSIONED.format(document.pk)
    response = client_alice.send("GET", url)
    assert response.status_code == 200
    assert response["ETag"] == '"1"'
    assert client_alice.send("HEAD", url)["ETag"] == '"1"'

    not_modified = client_alice.send("GET", url, headers={"If-None-Match": '"1"'})
    assert not_modified.status_code == 304
    assert not_modified["ETag"] == '"1"'
    assert not_modified.content == b""
    # If-None-Match compares weakly; another tag means the client's copy is stale.
    assert client_alice.send("GET", url, headers={"If-None-Match": 'W/"1"'}).status_code == 304
    assert client_alice.send("GET", url, headers={"If-None-Match": '"0"'}).status_code == 200


def test_an_update_with_the_current_etag_applies_and_answers_the_next_one(client_alice, document):
    url = VERSIONED.format(document.pk)
    response = patch(client_alice, url, {"title": "final"}, if_match='"1"')
    assert response.status_code == 200
    assert response["ETag"] == '"2"'
    assert response.json()["version"] == 2
    document.refresh_from_db()
    assert (document.title, document.version) == ("final", 2)
    assert client_alice.send("GET", url)["ETag"] == '"2"'


def test_a_stale_etag_is_a_412_with_the_current_one_and_changes_nothing(client_alice, document):
    url = VERSIONED.format(document.pk)
    assert patch(client_alice, url, {"title": "theirs"}, if_match='"1"').status_code == 200

    lost = patch(client_alice, url, {"title": "mine"}, if_match='"1"')
    assert_problem(lost, 412, "precondition.failed")
    assert lost["ETag"] == '"2"'
    document.refresh_from_db()
    assert (document.title, document.version) == ("theirs", 2)


@pytest.mark.parametrize(
    ("if_match", "status"),
    [('"0", "1"', 200), ("*", 200), ('W/"1"', 412), ('"2"', 412)],
    ids=["one-of-a-list", "any", "weak-never-matches", "other"],
)
def test_if_match_compares_strongly(client_alice, document, if_match, status):
    response = patch(client_alice, VERSIONED.format(document.pk), {"title": "x"}, if_match=if_match)
    assert response.status_code == status
    document.refresh_from_db()
    assert document.version == (2 if status == 200 else 1)


@pytest.mark.parametrize("if_match", ["1", '"1', '"1", 2', "", " , ", '"a"b"'])
@pytest.mark.parametrize("url", [VERSIONED, BY_CONTENT, PLAIN])
def test_a_malformed_if_match_is_a_400_not_an_unchecked_update(
    client_alice, document, url, if_match
):
    response = patch(client_alice, url.format(document.pk), {"title": "x"}, if_match=if_match)
    assert_problem(response, 400, "precondition.invalid")
    document.refresh_from_db()
    assert (document.title, document.version) == ("draft", 1)


def test_without_if_match_an_update_applies_unless_the_view_requires_it(client_alice, document):
    response = patch(client_alice, VERSIONED.format(document.pk), {"title": "blind"})
    assert response.status_code == 200
    assert response["ETag"] == '"2"'

    required = patch(client_alice, STRICT.format(document.pk), {"title": "blind again"})
    assert_problem(required, 428, "precondition.required")
    document.refresh_from_db()
    assert (document.title, document.version) == ("blind", 2)
    accepted = patch(client_alice, STRICT.format(document.pk), {"title": "ok"}, if_match='"2"')
    assert accepted.status_code == 200


def test_an_invalid_update_leaves_the_version_alone(client_alice, document):
    url = VERSIONED.format(document.pk)
    assert patch(client_alice, url, {"title": "x" * 201}, if_match='"1"').status_code == 400
    document.refresh_from_db()
    assert document.version == 1


def test_put_and_delete_are_conditional_too(client_alice, document):
    url = VERSIONED.format(document.pk)
    put = client_alice.send(
        "PUT", url, {"title": "new", "body": "all"}, headers={"If-Match": '"1"'}
    )
    assert put.status_code == 200
    assert put["ETag"] == '"2"'

    stale = client_alice.send("DELETE", url, headers={"If-Match": '"1"'})
    assert_problem(stale, 412, "precondition.failed")
    assert Document.objects.filter(pk=document.pk).exists()
    assert client_alice.send("DELETE", url, headers={"If-Match": '"2"'}).status_code == 204
    assert not Document.objects.filter(pk=document.pk).exists()


def test_a_missing_resource_is_a_404_whatever_the_precondition(client_alice):
    response = patch(client_alice, VERSIONED.format(999), {"title": "x"}, if_match='"1"')
    assert response.status_code == 404


def test_the_content_etag_is_the_same_for_every_renderer_and_changes_with_the_data(
    client_alice, document
):
    url = BY_CONTENT.format(document.pk)
    as_json = client_alice.send("GET", url)
    as_html = client_alice.send("GET", url, headers={"Accept": "text/html"})
    assert as_html["Content-Type"].startswith("text/html")
    assert as_json["ETag"] == as_html["ETag"]
    assert as_json["ETag"].startswith('"')
    assert len(as_json["ETag"]) == 34  # 32 hex digits, quoted

    updated = patch(client_alice, url, {"body": "edited"}, if_match=as_json["ETag"])
    assert updated.status_code == 200
    assert updated["ETag"] != as_json["ETag"]
    assert client_alice.send("GET", url)["ETag"] == updated["ETag"]

    stale = patch(client_alice, url, {"body": "mine"}, if_match=as_json["ETag"])
    assert_problem(stale, 412, "precondition.failed")
    assert stale["ETag"] == updated["ETag"]
    # Writing the same data back gives the same ETag: it names the content, not a write.
    same = patch(client_alice, url, {"body": "edited"}, if_match=updated["ETag"])
    assert same["ETag"] == updated["ETag"]


def test_a_plain_view_by_version(client, document):
    url = PLAIN.format(document.pk)
    assert client.get(url)["ETag"] == '"1"'
    assert client.get(url, headers={"If-None-Match": '"1"'}).status_code == 304

    response = client.patch(
        url, json.dumps({"title": "final"}), "application/json", headers={"If-Match": '"1"'}
    )
    assert response.status_code == 200
    assert response["ETag"] == '"2"'
    assert response.json() == {"id": document.pk, "title": "final", "version": 2}

    stale = client.patch(url, '{"title": "x"}', "application/json", headers={"If-Match": '"1"'})
    assert_problem(stale, 412, "precondition.failed")
    assert stale["ETag"] == '"2"'


def test_a_plain_view_that_answers_an_error_rolls_the_version_back(client, document):
    url = PLAIN.format(document.pk)
    response = client.patch(url, "{}", "application/json", headers={"If-Match": '"1"'})
    assert response.status_code == 400
    document.refresh_from_db()
    assert document.version == 1
    gone = client.delete(url, headers={"If-Match": '"1"'})
    assert gone.status_code == 204
    assert not Document.objects.exists()


def test_a_plain_view_by_content_that_requires_if_match(client, document):
    url = PLAIN_BY_CONTENT.format(document.pk)
    etag = client.get(url)["ETag"]
    assert_problem(
        client.patch(url, '{"title": "x"}', "application/json"), 428, "precondition.required"
    )
    applied = client.patch(url, '{"title": "x"}', "application/json", headers={"If-Match": etag})
    assert applied.status_code == 200
    assert applied["ETag"] not in {etag, None}
    stale = client.patch(url, '{"title": "y"}', "application/json", headers={"If-Match": etag})
    assert_problem(stale, 412, "precondition.failed")
    assert stale["ETag"] == applied["ETag"]


@pytest.mark.parametrize("url", [IDEMPOTENT, PLAIN_IDEMPOTENT])
def test_a_retried_update_with_its_key_replays_instead_of_failing_412(client_alice, document, url):
    url = url.format(document.pk)
    first = patch(client_alice, url, {"title": "final"}, if_match='"1"', key="edit-1")
    assert first.status_code == 200
    assert first["ETag"] == '"2"'

    retry = patch(client_alice, url, {"title": "final"}, if_match='"1"', key="edit-1")
    assert retry.status_code == 200
    assert retry["Idempotency-Status"] == "replayed"
    assert retry.content == first.content
    assert retry["ETag"] == '"2"'
    document.refresh_from_db()
    assert document.version == 2

    # Another key is another update: its version is stale.
    other = patch(client_alice, url, {"title": "final"}, if_match='"1"', key="edit-2")
    assert_problem(other, 412, "precondition.failed")


# Races on PostgreSQL: real threads, each with its own connection.


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("url", [VERSIONED, BY_CONTENT, PLAIN])
def test_concurrent_updates_with_one_etag_have_exactly_one_winner(alice, url):
    document = Document.objects.create(title="draft")
    etag = ApiClient(alice).send("GET", url.format(document.pk))["ETag"]

    def update(index):
        response = ApiClient(alice).send(
            "PATCH",
            url.format(document.pk),
            {"title": f"writer {index}"},
            headers={"If-Match": etag, "X-Hold": "0.1"},
        )
        return response.status_code

    statuses = in_threads(8, update)
    assert sorted(statuses) == [200] + [412] * 7
    document.refresh_from_db()
    winner = statuses.index(200)
    assert document.title == f"writer {winner}"


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_concurrent_unconditional_updates_all_apply_and_count_every_version(alice):
    document = Document.objects.create(title="draft")

    def update(index):
        return (
            ApiClient(alice)
            .send("PATCH", VERSIONED.format(document.pk), {"title": f"writer {index}"})
            .status_code
        )

    assert in_threads(8, update) == [200] * 8
    document.refresh_from_db()
    assert document.version == 9


@pytest.mark.server_db
@pytest.mark.django_db(transaction=True)
def test_concurrent_retries_of_one_keyed_update_answer_alike_and_apply_once(alice):
    document = Document.objects.create(title="draft")

    def update(_):
        response = ApiClient(alice).send(
            "PATCH",
            IDEMPOTENT.format(document.pk),
            {"title": "final"},
            key="one-edit",
            headers={"If-Match": '"1"', "X-Hold": "0.1"},
        )
        return response.status_code, response["ETag"], response.get("Idempotency-Status")

    answers = in_threads(8, update)
    assert {(status, etag) for status, etag, _ in answers} == {(200, '"2"')}
    assert sorted(outcome for *_, outcome in answers) == ["replayed"] * 7 + ["stored"]
    document.refresh_from_db()
    assert document.version == 2


def test_a_missing_object_under_a_plain_view_is_the_views_own_answer(client):
    def missing(request, pk):
        return HttpResponse(status=404)

    view = conditional(Document.objects.all(), version_field="version")(missing)
    request = RequestFactory().patch("/", "{}", "application/json", headers={"If-Match": '"1"'})
    assert view(request, pk=999).status_code == 404
    assert view(RequestFactory().get("/"), pk=999).status_code == 404


def test_a_delete_without_if_match_deletes(client_alice, document):
    assert client_alice.send("DELETE", VERSIONED.format(document.pk)).status_code == 204
    assert not Document.objects.exists()


@pytest.mark.parametrize("options", [{}, {"version_field": "version", "etag": str}])
def test_conditional_needs_exactly_one_source_of_etags(options):
    with pytest.raises(ImproperlyConfigured, match="exactly one of version_field and etag"):
        conditional(Document.objects.all(), **options)


def test_conditional_refuses_an_async_view():
    async def view(request, pk):  # pragma: no cover - never called
        return HttpResponse()

    with pytest.raises(ImproperlyConfigured, match="synchronous views only"):
        conditional(Document.objects.all(), version_field="version")(view)
