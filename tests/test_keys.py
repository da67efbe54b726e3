from __future__ import annotations

import json
import pickle
import re

import pytest
from django.http import JsonResponse
from django.test import override_settings
from django.urls import path
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from hypothesis import given
from hypothesis import strategies as st
from ninja import NinjaAPI, Status
from ninja.security import django_auth
from rest_framework.response import Response
from rest_framework.views import APIView

from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.keys import InvalidKey, ScopedKey, downstream_key, key_of, parse_key
from django_idempotency.models import IdempotencyKey
from django_idempotency.ninja import idempotent as idempotent_operation
from django_idempotency.reconcile import ExpiredKey
from tests.conftest import ApiClient

visible = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255)


@given(visible.filter(lambda key: not key.startswith('"') and "," not in key))
def test_any_visible_ascii_token_without_a_comma_is_its_own_key(key):
    assert parse_key(key) == key


@given(visible)
def test_the_quoted_form_carries_the_same_key(key):
    escaped = key.replace("\\", "\\\\").replace('"', '\\"')
    assert parse_key(f'"{escaped}"') == key


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty"),
        (" ", "outside visible ASCII"),
        ("a b", "outside visible ASCII"),
        ("\u00e9", "outside visible ASCII"),
        ("\x00", "outside visible ASCII"),
        ("x" * 256, "longer than 255"),
        ('"x', "not a valid string"),
        ('"a"b"', "not a valid string"),
        ('"\\n"', "not a valid string"),
        ('"a b"', "not a valid string"),
        ('""', "not a valid string"),
    ],
)
def test_bad_keys_say_why(value, reason):
    with pytest.raises(InvalidKey, match=reason):
        parse_key(value)


# A header sent twice reaches the view as one value joined by a comma (RFC 9110 section 5.3):
# every list shape is refused, whatever its members look like.
@pytest.mark.parametrize(
    "value",
    [
        "k,k",
        "a,b",
        "k,",
        ",k",
        ",",
        '"a", "b"',
        '"a","b"',
        '"a",b',
        'a,"b"',
        '"k","k"',
    ],
)
def test_a_list_of_keys_is_refused(value):
    with pytest.raises(InvalidKey, match="more than one key"):
        parse_key(value)


def test_a_quoted_key_may_hold_a_comma():
    assert parse_key('"a,b"') == "a,b"
    assert parse_key('","') == ","


# -- the key handed to the code the library runs --------------------------------------------------


def test_a_scoped_key_is_the_key_itself_and_keeps_its_scope_through_pickling():
    scoped = ScopedKey("K", "auth.user:1 POST charges/")
    again = pickle.loads(pickle.dumps(scoped))  # noqa: S301 - our own object
    assert (scoped, json.dumps(scoped)) == ("K", '"K"')
    assert (again, again.scope, again.downstream_key) == ("K", scoped.scope, scoped.downstream_key)


def test_the_downstream_key_is_the_same_for_one_scoped_key_and_differs_across_scopes():
    alice, bob = "auth.user:1 POST charges/", "auth.user:2 POST charges/"
    assert ScopedKey("K", alice).downstream_key == downstream_key(alice, "K")
    assert downstream_key(alice, "K") != downstream_key(bob, "K")
    # No scope and key can be cut in two ways into one downstream key.
    assert downstream_key("a b", "c") != downstream_key("a", "b c")
    assert re.fullmatch("[0-9a-f]{64}", downstream_key(alice, "K"))


def test_the_sweepers_hook_is_told_the_downstream_key_the_view_had():
    scope = "auth.user:1 POST charges/"
    expired = ExpiredKey(scope, "K", "charges/", "POST", "f" * 64, 1, timezone.now())
    assert expired.downstream_key == ScopedKey("K", scope).downstream_key
    with override_settings(IDEMPOTENCY={"DOWNSTREAM_KEY_NAMESPACE": "payments-production"}):
        assert expired.downstream_key == ScopedKey("K", scope).downstream_key


# What 1.0 gave a provider for this key, and what a namespace gives: a provider remembers a key
# for a day or more, so neither may change from one release to the next (a retry after an
# upgrade would be charged again).
PINNED_SCOPE = "auth.user:1 POST charges/"
PINNED = "10fe3cae0c4a30d798549ae621c4ae369cf1b23a7eeca735b49ba8d956c053c0"  # ["<scope>", "K"]
PINNED_IN_NAMESPACE = "4e2659bb1dd608565e2aa84c65af6175cdcd27ac766f28ad1f73db0712595ea3"


@pytest.mark.parametrize("setting", [{}, {"DOWNSTREAM_KEY_NAMESPACE": ""}])
def test_without_a_namespace_the_downstream_key_is_the_one_1_0_gave(setting):
    expired = ExpiredKey(PINNED_SCOPE, "K", "charges/", "POST", "f" * 64, 1, timezone.now())
    with override_settings(IDEMPOTENCY=setting):
        assert downstream_key(PINNED_SCOPE, "K") == PINNED
        assert ScopedKey("K", PINNED_SCOPE).downstream_key == PINNED
        assert expired.downstream_key == PINNED


def test_a_namespace_gives_the_project_downstream_keys_of_its_own():
    with override_settings(IDEMPOTENCY={"DOWNSTREAM_KEY_NAMESPACE": "payments-production"}):
        production = ScopedKey("K", PINNED_SCOPE).downstream_key
        assert downstream_key(PINNED_SCOPE, "K") == production == PINNED_IN_NAMESPACE
    with override_settings(IDEMPOTENCY={"DOWNSTREAM_KEY_NAMESPACE": "payments-staging"}):
        staging = ScopedKey("K", PINNED_SCOPE).downstream_key
    assert len({production, staging, PINNED}) == 3
    assert downstream_key(PINNED_SCOPE, "K", namespace="payments-staging") == staging
    assert downstream_key(PINNED_SCOPE, "K", namespace="") == PINNED


@given(st.text(min_size=1), st.text(), st.text())
def test_no_namespaced_key_is_an_unnamespaced_one(namespace, scope, key):
    # What a namespace joined to the scope or the key by hand would give, or the 1.0 key itself.
    namespaced = downstream_key(scope, key, namespace=namespace)
    assert namespaced not in {
        downstream_key(scope, key, namespace=""),
        downstream_key(namespace + scope, key, namespace=""),
        downstream_key(f"{namespace} {scope}", key, namespace=""),
        downstream_key(namespace, f"{scope} {key}", namespace=""),
    }


@csrf_exempt
@idempotent(required=False)
def echo_key(request):
    key = key_of(request)
    if key is None:
        return JsonResponse({"key": None}, status=201)
    return JsonResponse({"key": key, "downstream": key.downstream_key}, status=201)


@csrf_exempt
@idempotent
async def async_echo_key(request):
    key = key_of(request)
    return JsonResponse({"key": key, "downstream": key.downstream_key}, status=201)


class EchoKeyView(IdempotentMixin, APIView):
    def post(self, request):
        key = key_of(request)
        return Response({"key": key, "downstream": key.downstream_key}, status=201)


def recover_charge(request, *, key, attempt):
    return JsonResponse({"recovered": key, "downstream": key.downstream_key}, status=201)


@csrf_exempt
@idempotent(mode="lease", recover=recover_charge)
def charge(request):
    if request.headers.get("X-Fail"):
        msg = "the provider timed out"
        raise RuntimeError(msg)
    return JsonResponse({"charged": key_of(request).downstream_key}, status=201)


ninja_api = NinjaAPI(urls_namespace="keys-tests")


@ninja_api.post("/echo/", response={201: dict}, auth=django_auth)
@idempotent_operation
def ninja_echo_key(request):
    key = key_of(request)
    return Status(201, {"key": key, "downstream": key.downstream_key})


urlpatterns = [
    path("ninja/", ninja_api.urls),
    path("charge/", charge),
    path("plain/", echo_key),
    path("async/", async_echo_key),
    path("drf/", EchoKeyView.as_view()),
]


@pytest.mark.django_db
@pytest.mark.urls(__name__)
@pytest.mark.parametrize("route", ["/plain/", "/async/", "/drf/", "/ninja/echo/"])
def test_every_spelling_of_a_key_reaches_the_view_as_one_key_with_one_downstream_key(
    alice, bob, route
):
    def send(user, key):
        client = ApiClient(user)
        client.force_login(user)  # Django's own authentication, for the plain views
        answer = client.send("POST", route, {"amount": 1}, key=key)
        assert answer.status_code == 201, answer.content
        return answer

    quoted = send(alice, '"a\\"b\\\\c"')
    bare = send(alice, 'a"b\\c')  # the same key: replayed
    other_user = send(bob, 'a"b\\c')

    seen, seen_by_bob = json.loads(quoted.content), json.loads(other_user.content)
    assert (bare["Idempotency-Status"], bare.content) == ("replayed", quoted.content)
    assert seen["key"] == seen_by_bob["key"] == 'a"b\\c'
    assert seen_by_bob["downstream"] != seen["downstream"]
    row = IdempotencyKey.objects.get(key='a"b\\c', scope__startswith=f"auth.user:{alice.pk} ")
    assert seen["downstream"] == downstream_key(row.scope, row.key)


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls(__name__)
def test_two_services_that_share_a_provider_account_give_it_different_keys(alice):
    # Production and staging (or two services), each with its database, one provider account:
    # equal user ids, routes and keys. Equal downstream keys would have the provider replay
    # one's charge to the other.
    client = ApiClient(alice)
    client.force_login(alice)
    charged = {}
    for service in ("payments-production", "payments-staging"):
        with override_settings(IDEMPOTENCY={"DOWNSTREAM_KEY_NAMESPACE": service}):
            answer = client.send("POST", "/charge/", {"amount": 1}, key="order-42")
        assert answer.status_code == 201, answer.content
        charged[service] = json.loads(answer.content)["charged"]
        IdempotencyKey.objects.all().delete()  # the other service's database has no such key
    assert charged["payments-production"] != charged["payments-staging"]


@pytest.mark.django_db
@pytest.mark.urls(__name__)
def test_a_request_without_a_key_has_none(alice):
    answer = ApiClient(alice).send("POST", "/plain/", {"amount": 1})
    assert json.loads(answer.content) == {"key": None}


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls(__name__)
def test_the_recovery_hook_gets_the_key_the_view_had_whatever_the_retrys_spelling(alice):
    client = ApiClient(alice, raise_request_exception=False)
    client.force_login(alice)
    failed = client.send("POST", "/charge/", {"amount": 1}, key="k", headers={"X-Fail": "1"})
    retry = client.send("POST", "/charge/", {"amount": 1}, key='"k"')
    fresh = client.send("POST", "/charge/", {"amount": 1}, key="other")

    assert (failed.status_code, retry.status_code) == (500, 201)
    row = IdempotencyKey.objects.get(key="k")
    assert json.loads(retry.content) == {
        "recovered": "k",
        "downstream": downstream_key(row.scope, "k"),
    }
    other = IdempotencyKey.objects.get(key="other")
    assert json.loads(fresh.content) == {"charged": downstream_key(other.scope, "other")}
