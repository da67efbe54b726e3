"""The webhook signature schemes: signing, verifying, rotation, tolerance, malformed headers."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import subprocess
import sys
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency import inbox
from django_idempotency.inbox.verifiers import Verifier
from django_idempotency.signing import (
    GitHubSignature,
    HMACVerifier,
    SignatureError,
    StandardWebhooksSignature,
    StripeSignature,
)

NOW = 1_700_000_000
BODY = b'{"id": "evt_1", "type": "payment.succeeded"}'
SCHEMES = [StandardWebhooksSignature, StripeSignature, GitHubSignature]
TIMED_SCHEMES = [StandardWebhooksSignature, StripeSignature]


def at(now: float = NOW):
    return lambda: float(now)


def make(scheme, secrets, **options):
    if scheme is GitHubSignature:
        return scheme(secrets)
    options.setdefault("clock", at(NOW))
    return scheme(secrets, **options)


def sign(verifier, body, timestamp=None):
    if isinstance(verifier, StandardWebhooksSignature):
        return verifier.sign(body, msg_id="msg_1", timestamp=timestamp)
    if isinstance(verifier, StripeSignature):
        return verifier.sign(body, timestamp=timestamp)
    return verifier.sign(body)


def error_of(verifier, headers, body=BODY) -> SignatureError:
    with pytest.raises(SignatureError) as excinfo:
        verifier.verify(headers, body)
    return excinfo.value


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_what_is_signed_verifies(scheme):
    verifier = make(scheme, "s3cret")
    verifier.verify(sign(verifier, BODY), BODY)
    verifier.verify(sign(verifier, b""), b"")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_different_secret_is_invalid_and_the_error_tells_nothing_secret(scheme):
    headers = sign(make(scheme, "the-right-secret"), BODY)
    error = error_of(make(scheme, "a-wrong-secret"), headers)
    assert error.code == "inbox.signature_invalid"
    assert str(error) == error.detail
    for secret_or_data in ["the-right-secret", "a-wrong-secret", BODY.decode(), *headers.values()]:
        assert secret_or_data not in error.detail


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_tampered_body_is_invalid(scheme):
    verifier = make(scheme, "s3cret")
    headers = sign(verifier, BODY)
    assert error_of(verifier, headers, BODY + b" ").code == "inbox.signature_invalid"
    assert error_of(verifier, headers, BODY.replace(b"evt_1", b"evt_2")).code == (
        "inbox.signature_invalid"
    )


@pytest.mark.parametrize("scheme", TIMED_SCHEMES)
@pytest.mark.parametrize("skew", [-301, 301, -10_000, 10_000])
def test_a_timestamp_outside_the_tolerance_is_expired(scheme, skew):
    verifier = make(scheme, "s3cret", clock=at(NOW))
    headers = sign(verifier, BODY, timestamp=NOW + skew)
    assert error_of(verifier, headers).code == "inbox.signature_expired"


@pytest.mark.parametrize("scheme", TIMED_SCHEMES)
@pytest.mark.parametrize("skew", [-300, -1, 0, 1, 300])
def test_a_timestamp_inside_the_tolerance_verifies(scheme, skew):
    verifier = make(scheme, "s3cret", clock=at(NOW))
    verifier.verify(sign(verifier, BODY, timestamp=NOW + skew), BODY)


@pytest.mark.parametrize("scheme", TIMED_SCHEMES)
def test_the_tolerance_can_be_a_timedelta(scheme):
    verifier = make(scheme, "s3cret", tolerance=timedelta(seconds=10), clock=at(NOW))
    verifier.verify(sign(verifier, BODY, timestamp=NOW - 10), BODY)
    verifier.verify(sign(verifier, BODY, timestamp=NOW + 10), BODY)
    assert error_of(verifier, sign(verifier, BODY, timestamp=NOW - 11)).code == (
        "inbox.signature_expired"
    )
    assert error_of(verifier, sign(verifier, BODY, timestamp=NOW + 11)).code == (
        "inbox.signature_expired"
    )


@pytest.mark.parametrize("scheme", TIMED_SCHEMES)
@pytest.mark.parametrize("tolerance", [0, -1, timedelta(0), "300"])
def test_a_tolerance_that_is_not_a_positive_duration_is_a_configuration_error(scheme, tolerance):
    with pytest.raises(ImproperlyConfigured, match=f"{scheme.__name__} tolerance"):
        scheme("s3cret", tolerance=tolerance)


def test_the_clock_supplies_the_default_timestamp_when_signing():
    clock = at(NOW + 0.9)
    stripe = StripeSignature("s3cret", clock=clock).sign(BODY)
    assert stripe["Stripe-Signature"].startswith(f"t={NOW},v1=")
    standard = StandardWebhooksSignature("s3cret", clock=clock).sign(BODY, msg_id="msg_1")
    assert standard["webhook-timestamp"] == str(NOW)


def test_github_has_no_tolerance_window():
    signer = GitHubSignature("s3cret")
    headers = signer.sign(BODY)
    # The same delivery verifies whenever it arrives: GitHub signs no time at all.
    GitHubSignature("s3cret").verify(headers, BODY)
    with pytest.raises(TypeError):
        GitHubSignature("s3cret", tolerance=60)  # type: ignore[call-arg]


def test_a_tampered_standard_webhooks_timestamp_is_invalid_not_expired():
    verifier = StandardWebhooksSignature("s3cret", clock=at(NOW))
    headers = verifier.sign(BODY, msg_id="msg_1", timestamp=NOW)
    for forged in [NOW - 10_000, NOW + 10_000, NOW + 1]:
        error = error_of(verifier, {**headers, "webhook-timestamp": str(forged)})
        assert error.code == "inbox.signature_invalid"


def test_a_tampered_standard_webhooks_id_is_invalid():
    verifier = StandardWebhooksSignature("s3cret", clock=at(NOW))
    headers = verifier.sign(BODY, msg_id="msg_1", timestamp=NOW)
    assert error_of(verifier, {**headers, "webhook-id": "msg_2"}).code == (
        "inbox.signature_invalid"
    )


def test_a_tampered_stripe_timestamp_is_invalid_not_expired():
    verifier = StripeSignature("s3cret", clock=at(NOW))
    header = verifier.sign(BODY, timestamp=NOW)["Stripe-Signature"]
    for forged in [NOW - 10_000, NOW + 10_000, NOW + 1]:
        tampered = header.replace(f"t={NOW}", f"t={forged}")
        error = error_of(verifier, {"Stripe-Signature": tampered})
        assert error.code == "inbox.signature_invalid"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_rotated_secrets_accept_the_old_one_only_while_it_is_listed(scheme):
    headers = sign(make(scheme, "old"), BODY)
    make(scheme, ["new", "old"]).verify(headers, BODY)
    make(scheme, ("new", b"old")).verify(headers, BODY)
    assert error_of(make(scheme, ["new"]), headers).code == "inbox.signature_invalid"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_first_secret_signs(scheme):
    headers = sign(make(scheme, ["new", "old"]), BODY)
    make(scheme, "new").verify(headers, BODY)
    assert error_of(make(scheme, "old"), headers).code == "inbox.signature_invalid"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_callable_secrets_are_read_at_every_call(scheme):
    current = {"secrets": "first", "calls": 0}

    def secrets():
        current["calls"] += 1
        return current["secrets"]

    verifier = make(scheme, secrets)
    assert current["calls"] == 0
    first = sign(verifier, BODY)
    verifier.verify(first, BODY)
    current["secrets"] = ["second"]
    assert error_of(verifier, first).code == "inbox.signature_invalid"
    second = sign(verifier, BODY)
    assert second != first
    verifier.verify(second, BODY)
    current["secrets"] = ["second", "first"]
    verifier.verify(first, BODY)
    assert current["calls"] == 6


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    ("secrets", "message"),
    [
        pytest.param([], "has no secrets", id="empty-list"),
        pytest.param((), "has no secrets", id="empty-tuple"),
        pytest.param(list, "has no secrets", id="callable-empty-list"),
        pytest.param(lambda: None, "has no secrets", id="callable-none"),
        pytest.param("", "an empty secret", id="empty-str"),
        pytest.param(b"", "an empty secret", id="empty-bytes"),
        pytest.param(["ok", ""], "an empty secret", id="one-empty-secret"),
        pytest.param(lambda: [b"ok", b""], "an empty secret", id="callable-one-empty-secret"),
    ],
)
def test_missing_secrets_are_a_configuration_error(scheme, secrets, message):
    verifier = make(scheme, secrets)
    headers = sign(make(scheme, "s3cret"), BODY)
    with pytest.raises(ImproperlyConfigured, match=f"{scheme.__name__} .*{message}"):
        verifier.verify(headers, BODY)
    with pytest.raises(ImproperlyConfigured, match=message):
        sign(verifier, BODY)


@pytest.mark.parametrize(
    ("scheme", "header"),
    [
        (StandardWebhooksSignature, "webhook-id"),
        (StandardWebhooksSignature, "webhook-timestamp"),
        (StandardWebhooksSignature, "webhook-signature"),
        (StripeSignature, "Stripe-Signature"),
        (GitHubSignature, "X-Hub-Signature-256"),
    ],
)
def test_a_missing_header_is_reported_as_missing(scheme, header):
    verifier = make(scheme, "s3cret")
    headers = sign(verifier, BODY)
    del headers[header]
    error = error_of(verifier, headers)
    assert error.code == "inbox.signature_missing"
    assert error.detail == f"The {header} header is missing."
    assert error_of(verifier, {}).code == "inbox.signature_missing"


def _standard_webhooks_headers(**changes):
    headers = StandardWebhooksSignature("s3cret").sign(BODY, msg_id="msg_1", timestamp=NOW)
    headers.update(changes)
    return headers


_STANDARD_SIGNATURE = _standard_webhooks_headers()["webhook-signature"]
_STRIPE_HEX = hmac_sha256(b"s3cret", f"{NOW}.".encode() + BODY).hex()
_GITHUB_HEX = hmac_sha256(b"s3cret", BODY).hex()


@pytest.mark.parametrize(
    ("scheme", "headers"),
    [
        *[
            pytest.param(
                StandardWebhooksSignature,
                _standard_webhooks_headers(**{"webhook-timestamp": value}),
                id=f"webhook-timestamp={value!r}",
            )
            for value in [
                "",
                "soon",
                "-1",
                f"+{NOW}",
                f" {NOW}",
                f"{NOW}.0",
                "1_700_000_000",
                # Arabic-Indic digits, which int() would take.
                "\u0661\u0667" + "\u0660" * 8,
                "1" * 19,
            ]
        ],
        *[
            pytest.param(
                StandardWebhooksSignature,
                _standard_webhooks_headers(**{"webhook-signature": value}),
                id=f"webhook-signature={value!r}",
            )
            for value in [
                "",
                "v1",
                _STANDARD_SIGNATURE.replace("v1,", "v2,"),
                _STANDARD_SIGNATURE.replace("v1,", "v1a,"),
                _STANDARD_SIGNATURE.replace("v1,", "v1="),
                _STANDARD_SIGNATURE.replace("v1,", ""),
                "v1,not base64!",
                "v1,YWJ",
                f"v1,{_STANDARD_SIGNATURE[3:]}é",
                f"v1,%%% {_STANDARD_SIGNATURE}",
            ]
        ],
        *[
            pytest.param(StripeSignature, {"Stripe-Signature": value}, id=f"stripe={value!r}")
            for value in [
                "",
                f"v1={_STRIPE_HEX}",
                f"t=,v1={_STRIPE_HEX}",
                f"t=soon,v1={_STRIPE_HEX}",
                f"t=-{NOW},v1={_STRIPE_HEX}",
                f"t={NOW}",
                f"t={NOW},v0={_STRIPE_HEX}",
                f"t={NOW},t={NOW},v1={_STRIPE_HEX}",
                f"t={NOW},v1=xyz",
                f"t={NOW},v1=abc",
                f"t={NOW},v1={_STRIPE_HEX[:-1]}é",
                f"t={NOW},v1=zz,v1={_STRIPE_HEX}",
                f"{NOW},{_STRIPE_HEX}",
            ]
        ],
        *[
            pytest.param(GitHubSignature, {"X-Hub-Signature-256": value}, id=f"github={value!r}")
            for value in [
                "",
                "sha256",
                _GITHUB_HEX,
                f"sha1={_GITHUB_HEX}",
                f"sha512={_GITHUB_HEX}",
                f"sha256:{_GITHUB_HEX}",
                "sha256=xyz",
                f"sha256={_GITHUB_HEX[:-1]}",
                f"sha256={_GITHUB_HEX} ",
                f"sha256={_GITHUB_HEX[:-1]}é",
            ]
        ],
    ],
)
def test_a_malformed_header_is_invalid(scheme, headers):
    error = error_of(make(scheme, "s3cret", clock=at(NOW)), headers)
    assert error.code == "inbox.signature_invalid"
    for value in headers.values():
        if len(value) > 3:
            assert value not in error.detail


def test_stripe_accepts_any_v1_entry_and_ignores_the_rest():
    signed = StripeSignature("s3cret").sign(BODY, timestamp=NOW)["Stripe-Signature"]
    right = signed.split(",v1=")[1]
    wrong = StripeSignature("other").sign(BODY, timestamp=NOW)["Stripe-Signature"].split("v1=")[1]
    assert right != wrong
    verifier = StripeSignature("s3cret", clock=at(NOW))
    verifier.verify({"Stripe-Signature": f"t={NOW},v1={wrong},v1={right}"}, BODY)
    verifier.verify({"Stripe-Signature": f"t={NOW}, v1={wrong}, v1={right}, v0=ab, x"}, BODY)
    verifier.verify({"Stripe-Signature": f"v1={right},scheme=next,t={NOW}"}, BODY)
    error = error_of(verifier, {"Stripe-Signature": f"t={NOW},v1={wrong},v1={wrong}"})
    assert error.code == "inbox.signature_invalid"


def test_standard_webhooks_accepts_any_v1_entry_and_ignores_other_versions():
    verifier = StandardWebhooksSignature("s3cret", clock=at(NOW))
    right = verifier.sign(BODY, msg_id="msg_1", timestamp=NOW)["webhook-signature"]
    wrong = StandardWebhooksSignature("other").sign(BODY, msg_id="msg_1", timestamp=NOW)[
        "webhook-signature"
    ]
    base = {"webhook-id": "msg_1", "webhook-timestamp": str(NOW)}
    verifier.verify({**base, "webhook-signature": f"{wrong} {right}"}, BODY)
    verifier.verify({**base, "webhook-signature": f"v1a,{right[3:]} {right} v2,xyz"}, BODY)
    error = error_of(verifier, {**base, "webhook-signature": f"{wrong} v1a,{right[3:]}"})
    assert error.code == "inbox.signature_invalid"


def test_standard_webhooks_decodes_whsec_secrets():
    key = bytes(range(32))
    encoded = base64.b64encode(key).decode()
    verifier = StandardWebhooksSignature("whsec_" + encoded, clock=at(NOW))
    headers = verifier.sign(BODY, msg_id="msg_1", timestamp=NOW)
    expected = hmac_sha256(key, f"msg_1.{NOW}.".encode() + BODY)
    assert headers["webhook-signature"] == "v1," + base64.b64encode(expected).decode()
    # The decoded key is the secret: raw bytes verify; the base64 text as UTF-8 does not.
    StandardWebhooksSignature(key, clock=at(NOW)).verify(headers, BODY)
    assert error_of(StandardWebhooksSignature(encoded, clock=at(NOW)), headers).code == (
        "inbox.signature_invalid"
    )
    # Only a str carries the prefix; bytes are used as they are.
    raw = b"whsec_" + encoded.encode()
    assert error_of(StandardWebhooksSignature(raw, clock=at(NOW)), headers).code == (
        "inbox.signature_invalid"
    )


@pytest.mark.parametrize("secret", ["whsec_not base64!", "whsec_YWJ", "whsec_é"])
def test_a_whsec_secret_that_is_not_base64_is_a_configuration_error(secret):
    verifier = StandardWebhooksSignature(secret)
    with pytest.raises(ImproperlyConfigured, match="whsec_ secret") as excinfo:
        verifier.sign(BODY, msg_id="msg_1")
    assert secret not in str(excinfo.value)
    with pytest.raises(ImproperlyConfigured, match="whsec_ secret"):
        verifier.verify(_standard_webhooks_headers(), BODY)


def test_standard_webhooks_known_answer():
    # The example published with the Standard Webhooks specification.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    published = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    key = base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    digest = hmac_sha256(key, b"msg_p5jXN8AQM9LWM0D4loKWxJek.1614265330." + body)
    assert "v1," + base64.b64encode(digest).decode() == published

    verifier = StandardWebhooksSignature(secret, clock=at(1614265330))
    headers = verifier.sign(body, msg_id="msg_p5jXN8AQM9LWM0D4loKWxJek", timestamp=1614265330)
    assert headers == {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": published,
    }
    verifier.verify(headers, body)

    plain = StandardWebhooksSignature("plain secret", clock=at(NOW))
    digest = hmac_sha256(b"plain secret", f"evt.{NOW}.".encode() + BODY)
    assert plain.sign(BODY, msg_id="evt", timestamp=NOW)["webhook-signature"] == (
        "v1," + base64.b64encode(digest).decode()
    )


def test_stripe_known_answer():
    # Stripe's secrets also start with whsec_, but the whole string is the key.
    secret = "whsec_stripe_endpoint_secret"
    hexdigest = hmac.new(secret.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    verifier = StripeSignature(secret, clock=at(NOW))
    assert verifier.sign(BODY, timestamp=NOW) == {"Stripe-Signature": f"t={NOW},v1={hexdigest}"}
    verifier.verify({"Stripe-Signature": f"t={NOW},v1={hexdigest}"}, BODY)


def test_github_known_answer():
    # The example in GitHub's "Validating webhook deliveries" documentation.
    secret = "It's a Secret to Everybody"
    body = b"Hello, World!"
    published = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest() == published
    verifier = GitHubSignature(secret)
    assert verifier.sign(body) == {"X-Hub-Signature-256": published}
    verifier.verify({"X-Hub-Signature-256": published}, body)
    verifier.verify({"X-Hub-Signature-256": published.upper().replace("SHA256", "sha256")}, body)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("spell", [str.lower, str.upper, str.title])
def test_plain_dict_headers_in_any_case_verify(scheme, spell):
    verifier = make(scheme, "s3cret")
    headers = {spell(name): value for name, value in sign(verifier, BODY).items()}
    verifier.verify(headers, BODY)
    assert error_of(verifier, headers, BODY + b"!").code == "inbox.signature_invalid"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_django_request_headers_verify(scheme):
    verifier = make(scheme, "s3cret")
    request = RequestFactory().post(
        "/hooks/", BODY, content_type="application/json", headers=sign(verifier, BODY)
    )
    verifier.verify(request.headers, request.body)
    missing = RequestFactory().post("/hooks/", BODY, content_type="application/json")
    assert error_of(verifier, missing.headers).code == "inbox.signature_missing"


def test_the_verifiers_are_verifiers_and_the_base_is_abstract():
    for scheme in SCHEMES:
        assert isinstance(make(scheme, "s3cret"), Verifier)
        assert issubclass(scheme, HMACVerifier)
    assert not isinstance(object(), Verifier)
    with pytest.raises(TypeError):
        HMACVerifier("s3cret")  # type: ignore[abstract]
    # The inbox's old path to them still gives the very same schemes, with a warning.
    for name in ("HMACVerifier", "SignatureError", *(scheme.__name__ for scheme in SCHEMES)):
        with pytest.warns(DeprecationWarning, match="django_idempotency.signing"):
            assert getattr(inbox, name) is globals()[name]


# What a plain script that sends test webhooks does: no Django settings anywhere.
PLAIN_SCRIPT = """
import django.conf
from django_idempotency.signing import StandardWebhooksSignature, StripeSignature

body = b'{"id": "evt_1"}'
for signer, headers in (
    (StandardWebhooksSignature("whsec_dGVzdHMtb25seQ=="), {"msg_id": "msg_1"}),
    (StripeSignature("whsec_tests-only"), {}),
):
    signer.verify(signer.sign(body, **headers), body)
    try:
        signer.verify(signer.sign(body, **headers), body + b" ")
    except Exception as error:
        print(type(error).__name__, error.code)
print("settings configured:", django.conf.settings.configured)
"""


def test_signing_imports_and_works_without_django_settings():
    env = {name: value for name, value in os.environ.items() if name != "DJANGO_SETTINGS_MODULE"}
    completed = subprocess.run(
        [sys.executable, "-c", PLAIN_SCRIPT],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == [
        "SignatureError inbox.signature_invalid",
        "SignatureError inbox.signature_invalid",
        "settings configured: False",
    ]


def test_signature_error_carries_code_and_detail():
    error = SignatureError("inbox.signature_expired", "Too old.")
    assert (error.code, error.detail, str(error)) == (
        "inbox.signature_expired",
        "Too old.",
        "Too old.",
    )


secret_values = st.binary(min_size=1, max_size=64) | st.text(min_size=1, max_size=32).filter(
    lambda secret: not secret.startswith("whsec_")
)


@given(
    scheme=st.sampled_from(SCHEMES),
    secret=secret_values,
    body=st.binary(min_size=1, max_size=512),
    data=st.data(),
)
def test_signed_bodies_verify_and_any_flipped_byte_does_not(scheme, secret, body, data):
    verifier = make(scheme, secret)
    headers = sign(verifier, body)
    verifier.verify(headers, body)
    index = data.draw(st.integers(min_value=0, max_value=len(body) - 1), label="index")
    flip = data.draw(st.integers(min_value=1, max_value=255), label="flip")
    tampered = bytearray(body)
    tampered[index] ^= flip
    with pytest.raises(SignatureError) as excinfo:
        verifier.verify(headers, bytes(tampered))
    assert excinfo.value.code == "inbox.signature_invalid"
