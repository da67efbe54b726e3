from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_idempotency.conf import DEFAULTS, as_timedelta, idempotency_settings, resolve_callable
from django_idempotency.scope import default_scope


@override_settings(IDEMPOTENCY={})
def test_defaults_when_unset():
    for name, value in DEFAULTS.items():
        if name not in (
            "SCOPE_FUNCTION",
            "METHODS",
            "RETRYABLE_STATUS_CODES",
            "INVALID_REQUEST_STATUS_CODES",
        ):
            assert getattr(idempotency_settings, name) == value
    assert idempotency_settings.SCOPE_FUNCTION is default_scope
    assert {400, 406, 413, 415, 422} == idempotency_settings.INVALID_REQUEST_STATUS_CODES


def test_overrides_are_read_live():
    with override_settings(IDEMPOTENCY={"WAIT_TIMEOUT": 0.5, "HEADER": "X-Key"}):
        assert idempotency_settings.WAIT_TIMEOUT == 0.5
        assert idempotency_settings.HEADER == "X-Key"
    assert idempotency_settings.WAIT_TIMEOUT == 3.0


def test_a_callable_or_a_dotted_path():
    assert resolve_callable(default_scope, "X") is default_scope
    assert resolve_callable("django_idempotency.scope.default_scope", "X") is default_scope


@pytest.mark.parametrize("value", ["no.such.module.function", "django_idempotency.conf.DEFAULTS"])
def test_bad_callables_name_the_setting(value):
    with pytest.raises(ImproperlyConfigured, match="IDEMPOTENCY\\['SCOPE_FUNCTION'\\]"):
        resolve_callable(value, "IDEMPOTENCY['SCOPE_FUNCTION']")


@pytest.mark.parametrize("value", [0, -1, "1h", True, timedelta(0)])
def test_bad_ttls_name_the_setting(value):
    with pytest.raises(ImproperlyConfigured, match="TTL"):
        as_timedelta(value, "TTL")


def test_bad_anonymous_policy_names_the_setting():
    with (
        override_settings(IDEMPOTENCY={"ANONYMOUS": "allow"}),
        pytest.raises(ImproperlyConfigured, match="ANONYMOUS"),
    ):
        _ = idempotency_settings.ANONYMOUS


def test_a_non_dict_setting_reads_as_defaults():
    with override_settings(IDEMPOTENCY=["not", "a", "dict"]):
        assert timedelta(hours=24) == idempotency_settings.TTL


def test_the_json_depth_is_read_live_and_a_bad_one_names_the_setting():
    assert idempotency_settings.MAX_JSON_DEPTH == 31
    with override_settings(IDEMPOTENCY={"MAX_JSON_DEPTH": 64}):
        assert idempotency_settings.MAX_JSON_DEPTH == 64
    with (
        override_settings(IDEMPOTENCY={"MAX_JSON_DEPTH": 5000}),
        pytest.raises(ImproperlyConfigured, match=r"MAX_JSON_DEPTH.*E034.*from 1 to 200"),
    ):
        _ = idempotency_settings.MAX_JSON_DEPTH
