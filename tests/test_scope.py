from __future__ import annotations

from types import SimpleNamespace

import pytest
from django.contrib.auth.models import AnonymousUser, User
from django.test import override_settings

from django_idempotency.scope import AnonymousRejected, default_scope, get_principal


class Merchant:
    """An API principal that is not a Django model, with the same pk as a user."""

    is_authenticated = True
    pk = 1


def test_the_principal_names_its_kind_so_equal_pks_never_collide():
    user = User(pk=1, username="alice")
    assert get_principal(SimpleNamespace(user=user)) == "auth.user:1"
    assert get_principal(SimpleNamespace(user=Merchant())) == "Merchant:1"


def test_the_default_scope():
    request = SimpleNamespace(user=User(pk=7), method="POST")
    assert default_scope(request, "payments/") == "auth.user:7 POST payments/"


def test_anonymous_requests_share_a_principal_by_default():
    assert get_principal(SimpleNamespace(user=AnonymousUser())) == "anonymous"
    assert get_principal(SimpleNamespace()) == "anonymous"


@override_settings(IDEMPOTENCY={"ANONYMOUS": "reject"})
def test_anonymous_requests_can_be_rejected():
    with pytest.raises(AnonymousRejected):
        get_principal(SimpleNamespace(user=AnonymousUser()))
