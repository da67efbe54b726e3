"""The sweeper settles expired leases by asking the RECONCILE hook what became of the effect."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.http import JsonResponse
from django.test import override_settings
from django.urls import path
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from django_idempotency.core import hooks
from django_idempotency.core.sweeper import NEEDS_ATTENTION, hooks_by_route
from django_idempotency.decorators import idempotent
from django_idempotency.drf import IdempotentMixin
from django_idempotency.models import IdempotencyKey
from django_idempotency.reconcile import NothingHappened, Reconciled, Unknown
from tests.conftest import ApiClient
from tests.factories import IdempotencyKeyFactory
from tests.testapp.models import Payment
from tests.testapp.views import LeasePaymentView

ASKED: list[tuple[str, str, int]] = []


def answer_created(expired):
    ASKED.append((expired.key, expired.route, expired.attempts))
    return Reconciled(201, {"Content-Type": "application/json"}, json.dumps({"id": 7}))


def nothing(expired):
    ASKED.append((expired.key, expired.route, expired.attempts))
    return NothingHappened()


def unknown(expired):
    ASKED.append((expired.key, expired.route, expired.attempts))
    return Unknown("the provider did not say")


def by_key(expired):
    """One hook for the whole project: what it answers depends on the key."""
    if expired.key == "boom":
        raise RuntimeError("provider down")
    if expired.key == "slow":
        # Abandoned after RECONCILE_TIMEOUT, it wakes up when the test is over: it must leave
        # no trace in ASKED, which the next test reads.
        time.sleep(1)
        return Unknown("too late")
    return {"done": answer_created, "none": nothing}.get(expired.key, unknown)(expired)


class ReconciledLeaseView(LeasePaymentView):
    idempotency_reconcile = staticmethod(answer_created)


@idempotent(mode="lease", reconcile="tests.test_reconcile.nothing")
def plain_charge(request):
    return JsonResponse({"charged": True}, status=201)


urlpatterns = [
    path("reconciled/", ReconciledLeaseView.as_view()),
    path("plain/<int:account>/", plain_charge),
    path("lease/", LeasePaymentView.as_view()),
]


@pytest.fixture(autouse=True)
def _forget():
    ASKED.clear()


def died(answer):
    """Make the request that gave ``answer`` look as if its worker died before storing it."""
    assert answer.status_code == 201
    IdempotencyKey.objects.update(
        state="in_progress",
        locked_until=timezone.now() - timedelta(seconds=1),
        response_status=None,
        response_body=None,
    )
    Payment.objects.all().delete()


def stuck(key, route="lease/", **kwargs):
    return IdempotencyKeyFactory(key=key, route=route, lease_expired=True, **kwargs)


@pytest.mark.django_db(transaction=True)
class TestSweepWithAHook:
    @override_settings(IDEMPOTENCY={"RECONCILE": answer_created})
    def test_a_reconciled_response_is_stored_fenced_and_replayed(self, alice):
        row = stuck("done", route="lease/", scope=f"user:{alice.pk}|POST|lease/")

        assert IdempotencyKey.objects.sweep_expired_leases() == 1

        row.refresh_from_db()
        assert ASKED == [("done", "lease/", 1)]
        assert (row.state, row.response_status, row.lease_version) == ("succeeded", 201, 2)
        assert row.locked_until is None
        assert bytes(row.response_body) == b'{"id": 7}'

    @override_settings(IDEMPOTENCY={"RECONCILE": "tests.test_reconcile.by_key"})
    def test_each_answer_settles_its_key_and_an_error_leaves_it_for_the_next_run(self, caplog):
        stuck("done"), stuck("none"), stuck("unsure"), stuck("boom")

        assert IdempotencyKey.objects.sweep_expired_leases() == 2

        states = dict(IdempotencyKey.objects.values_list("key", "state"))
        assert states == {
            "done": "succeeded", "none": "failed", "unsure": "in_progress", "boom": "in_progress"
        }  # fmt: skip
        attention = IdempotencyKey.objects.filter(NEEDS_ATTENTION)
        assert list(attention.values_list("key", flat=True)) == ["unsure"]
        assert "provider down" in caplog.text
        # Still expired: a retry takes either over at once; only "boom" is asked again.
        assert not IdempotencyKey.objects.filter(
            key__in=["unsure", "boom"], locked_until__gt=timezone.now()
        ).exists()
        ASKED.clear()
        assert IdempotencyKey.objects.sweep_expired_leases() == 0
        assert "provider down" in caplog.text
        assert ASKED == []  # "unsure" waits for a person; "boom" raised again before asking

    @override_settings(IDEMPOTENCY={"RECONCILE": by_key, "RECONCILE_TIMEOUT": 0.2})
    def test_a_hook_that_times_out_is_left_for_the_next_run(self, caplog):
        stuck("slow"), stuck("done")

        assert IdempotencyKey.objects.sweep_expired_leases() == 1

        states = dict(IdempotencyKey.objects.values_list("key", "state"))
        assert states == {"slow": "in_progress", "done": "succeeded"}
        assert "did not answer within 0.2 s" in caplog.text
        assert not IdempotencyKey.objects.filter(NEEDS_ATTENTION).exists()

    @override_settings(IDEMPOTENCY={"RECONCILE": unknown})
    def test_a_retry_of_an_unknown_key_takes_it_over_and_asks_the_view(self, alice):
        from tests.testapp.views import RecoveringLeasePaymentView  # noqa: PLC0415

        RecoveringLeasePaymentView.recovered.clear()
        client = ApiClient(alice)
        with override_settings(ROOT_URLCONF="tests.testapp.urls"):
            first = client.send("POST", "/lease-recovering/", {"amount": 5}, key="unsure")
            died(first)
            IdempotencyKey.objects.sweep_expired_leases()
            assert IdempotencyKey.objects.filter(NEEDS_ATTENTION).count() == 1
            assert IdempotencyKey.objects.sweep_expired_leases() == 0  # not asked again
            assert ASKED == [("unsure", "lease-recovering/", 1)]
            retry = client.send("POST", "/lease-recovering/", {"amount": 5}, key="unsure")

        assert (retry.status_code, retry["Idempotency-Status"]) == (201, "stored")
        assert RecoveringLeasePaymentView.recovered == [("unsure", 2)]
        row = IdempotencyKey.objects.get()
        assert (row.state, row.attempts) == ("succeeded", 2)
        assert not IdempotencyKey.objects.filter(NEEDS_ATTENTION).exists()
        assert Payment.objects.count() == 1  # the charge was recorded once

    def test_a_view_names_its_own_hook_found_through_the_url_pattern(self):
        with override_settings(ROOT_URLCONF="tests.test_reconcile"):
            assert hooks_by_route() == {
                ("reconciled/", None): answer_created, ("plain/<int:account>/", None): nothing
            }  # fmt: skip
            stuck("done", route="reconciled/"), stuck("other", route="lease/")
            assert IdempotencyKey.objects.sweep_expired_leases() == 2
        states = dict(IdempotencyKey.objects.values_list("key", "state"))
        assert states == {"done": "succeeded", "other": "failed"}  # no hook: released
        assert ASKED == [("done", "reconciled/", 1)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.server_db
class TestSweepRaces:
    @override_settings(IDEMPOTENCY={"RECONCILE": by_key})
    def test_parallel_sweepers_ask_about_each_key_once(self):
        for i in range(40):
            stuck("done" if i % 2 else "none", scope=f"s{i}")
        from tests.test_store import in_threads  # noqa: PLC0415

        settled = in_threads(4, lambda _: IdempotencyKey.objects.sweep_expired_leases(batch_size=5))
        assert sum(settled) == 40
        assert len(ASKED) == 40
        states = IdempotencyKey.objects.values_list("state", flat=True)
        assert sorted(set(states)) == ["failed", "succeeded"]

    def test_a_retry_that_takes_the_key_over_while_the_hook_runs_wins(self, alice):
        # The hook is slow; meanwhile the client's retry finds the sweeper's lease, waits,
        # and is told to come back; once the sweeper stored the answer, the retry replays it.
        started = threading.Event()

        def slow_hook(expired):
            started.set()
            time.sleep(0.5)
            return Reconciled(201, {"Content-Type": "application/json"}, b'{"id": 99}')

        settings = {"RECONCILE": slow_hook, "WAIT_TIMEOUT": 0.1}
        with override_settings(IDEMPOTENCY=settings):
            client = ApiClient(alice)
            died(client.send("POST", "/lease/", {"amount": 5}, key="raced"))
            results = []
            sweeper = threading.Thread(
                target=lambda: (
                    results.append(IdempotencyKey.objects.sweep_expired_leases()),
                    connection.close(),
                )
            )
            sweeper.start()
            assert started.wait(5)
            during = client.send("POST", "/lease/", {"amount": 5}, key="raced")
            sweeper.join()
            after = client.send("POST", "/lease/", {"amount": 5}, key="raced")

        assert results == [1]
        assert during.status_code == 409  # the sweeper holds the key while it asks
        assert (after.status_code, after["Idempotency-Status"]) == (201, "replayed")
        assert after.content == b'{"id": 99}'
        assert not Payment.objects.exists()  # the view did not run again

    def test_a_retry_that_took_the_key_over_first_is_not_overwritten(self, alice):
        # The client's retry took the expired lease over just before the sweeper asked.
        def hook(expired):
            return Reconciled(201, {}, b"from the sweeper")

        with override_settings(IDEMPOTENCY={"RECONCILE": hook}):
            row = stuck("late")
            version = row.lease_version
            IdempotencyKey.objects.filter(pk=row.pk).update(
                lease_version=version + 1, locked_until=timezone.now() + timedelta(minutes=1)
            )
            assert IdempotencyKey.objects.sweep_expired_leases() == 0
        row.refresh_from_db()
        assert (row.state, row.lease_version, row.response_body) == ("in_progress", 2, None)


@pytest.mark.django_db
def test_the_admin_lists_the_keys_that_need_attention(admin_client):
    waiting = stuck("unsure", unsettled_lease_version=1)
    stuck("asked before a retry took it over", unsettled_lease_version=0)
    response = admin_client.get("/admin/django_idempotency/idempotencykey/", {"attention": "yes"})
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == [waiting]


@pytest.mark.django_db
def test_the_metrics_count_the_keys_that_need_attention():
    from prometheus_client import REGISTRY, generate_latest  # noqa: PLC0415

    stuck("unsure", unsettled_lease_version=1)
    stuck("retried since", unsettled_lease_version=0)
    assert b"django_idempotency_unsettled_leases 1.0" in generate_latest(REGISTRY)


@pytest.mark.django_db
def test_the_sweep_command_says_what_the_hook_answered():
    from io import StringIO  # noqa: PLC0415

    from django.core.management import call_command  # noqa: PLC0415

    stuck("done"), stuck("none"), stuck("unsure")
    out = StringIO()
    with override_settings(IDEMPOTENCY={"RECONCILE": by_key}):
        call_command("idempotency_sweep", stdout=out)
    assert out.getvalue().strip() == (
        "Swept 2 expired leases: 1 released, 1 reconciled, 1 left for a person, 0 hook errors."
    )


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"RECONCILE": "no.such.hook"}, "django_idempotency.E030"),
        ({"RECONCILE": 3}, "django_idempotency.E030"),
        ({"RECONCILE_TIMEOUT": 0}, "django_idempotency.E031"),
    ],
)
def test_the_checks_refuse_a_wrong_reconcile_setting(settings, problem):
    from django.core.checks import run_checks  # noqa: PLC0415

    # No database: from Django 6.1 the model checks would otherwise ask it what it supports.
    with override_settings(IDEMPOTENCY=settings):
        ids = [message.id for message in run_checks(databases=[])]
    assert problem in ids


def test_a_result_built_from_a_response_keeps_what_a_replay_keeps():
    response = JsonResponse({"id": 3}, status=201)
    response["Location"] = "/payments/3/"
    response.set_cookie("session", "secret")
    result = Reconciled.of(response)
    headers, body = result.stored()
    assert (result.status, body) == (201, b'{"id": 3}')
    assert ("Location", "/payments/3/") in headers
    assert not any(name.lower() == "set-cookie" for name, _ in headers)
    assert Reconciled(200, [("X-A", "1")], "é").stored() == ([("X-A", "1")], "é".encode())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "answer", [Reconciled(503, {}, b""), "yes", None], ids=["a 5xx", "a string", "None"]
)
def test_an_answer_that_is_not_a_result_is_left_for_the_next_run(answer, caplog):
    stuck("odd")
    with override_settings(IDEMPOTENCY={"RECONCILE": lambda expired: answer}):
        assert IdempotencyKey.objects.sweep_expired_leases() == 0
    row = IdempotencyKey.objects.get()
    assert (row.state, row.unsettled_lease_version) == ("in_progress", None)
    assert row.locked_until <= timezone.now()
    assert "the reconcile hook answered" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_the_admin_can_release_a_key_left_for_a_person(admin_client):
    with override_settings(IDEMPOTENCY={"RECONCILE": unknown}):
        row = stuck("unsure")
        IdempotencyKey.objects.sweep_expired_leases()
        IdempotencyKey.objects.sweep_expired_leases()
    row.refresh_from_db()
    assert (row.state, row.unsettled_lease_version) == ("in_progress", row.lease_version)
    with override_settings(IDEMPOTENCY={}):
        assert IdempotencyKey.objects.sweep_expired_leases() == 0  # nor without the hook
    response = admin_client.post(
        "/admin/django_idempotency/idempotencykey/",
        {"action": "release_expired_leases", "_selected_action": [row.pk]},
    )
    assert response.status_code == 302
    row.refresh_from_db()
    assert row.state == "failed"
    assert not IdempotencyKey.objects.filter(NEEDS_ATTENTION).exists()


@pytest.mark.django_db
def test_a_view_s_hook_is_checked_at_startup_like_the_setting():
    # The request path never reads it: a hook that names nothing fails the checks, not a sweep.
    from django_idempotency.operations.checks import check_views  # noqa: PLC0415

    @idempotent(mode="lease", reconcile="no.such.hook")
    def charge(request):
        return JsonResponse({}, status=201)

    class URLConf:
        urlpatterns = [path("charge/", charge)]

    with override_settings(ROOT_URLCONF=URLConf):
        messages = check_views()
    assert [(message.id, message.obj) for message in messages] == [
        ("django_idempotency.E033", charge)
    ]
    assert "reconcile option" in messages[0].msg


@pytest.mark.django_db(transaction=True)
@pytest.mark.server_db
def test_sweepers_and_retries_at_once_settle_each_key_with_one_answer(alice):
    from tests.test_store import in_threads  # noqa: PLC0415
    from tests.testapp.models import Charge  # noqa: PLC0415

    keys = [f"dead-{i}" for i in range(12)]

    def hook(expired):
        time.sleep(0.02)
        return Reconciled(201, {"Content-Type": "application/json"}, b'{"by": "sweeper"}')

    with override_settings(IDEMPOTENCY={"RECONCILE": hook, "WAIT_TIMEOUT": 2}):
        for key in keys:
            answer = ApiClient(alice).send("POST", "/lease-recovering/", {"amount": 5}, key=key)
            assert answer.status_code == 201
        # Every request died after the charge, before its answer was stored.
        IdempotencyKey.objects.update(
            state="in_progress",
            locked_until=timezone.now() - timedelta(seconds=1),
            response_status=None,
            response_body=None,
        )
        Payment.objects.all().delete()

        def work(index):
            if index < 3:
                return IdempotencyKey.objects.sweep_expired_leases(batch_size=4)
            time.sleep(0.02 * index)  # spread out: some keys go to a sweeper, some to a retry
            return ApiClient(alice).send(
                "POST", "/lease-recovering/", {"amount": 5}, key=keys[index - 3]
            )

        results = in_threads(3 + len(keys), work)
        finals = [
            ApiClient(alice).send("POST", "/lease-recovering/", {"amount": 5}, key=key)
            for key in keys
        ]

    sweeps, retries = results[:3], results[3:]
    stored_by_retries = [r for r in retries if r["Idempotency-Status"] == "stored"]
    assert sum(sweeps) + len(stored_by_retries) == len(keys)  # each key settled once
    for retry, final in zip(retries, finals, strict=True):
        assert retry.status_code == 201  # a replay, or the retry's own recovery
        assert (final.status_code, final["Idempotency-Status"]) == (201, "replayed")
        assert final.content == retry.content  # one answer per key, whoever stored it
    assert all(charge.calls == 1 for charge in Charge.objects.all())  # no second charge
    assert not IdempotencyKey.objects.filter(state="in_progress").exists()


def ninja_charged(expired):
    ASKED.append((expired.key, expired.route, expired.attempts))
    return Reconciled(201, {"Content-Type": "application/json"}, json.dumps({"ninja": True}))


def _ninja_urlconf():
    """A Ninja path whose POST has a reconcile hook and whose PATCH, on the same path, has none."""
    from ninja import NinjaAPI, Router, Status  # noqa: PLC0415 - an optional extra

    from django_idempotency.ninja import idempotent as ninja_idempotent  # noqa: PLC0415

    router = Router()

    @router.post("/charges/", response={201: dict})
    @ninja_idempotent(mode="lease", reconcile=ninja_charged)
    def charge(request):
        return Status(201, {"charged": True})

    @router.patch("/charges/", response={201: dict})
    @ninja_idempotent(mode="lease")
    def replace(request):
        return Status(201, {"replaced": True})

    api = NinjaAPI(urls_namespace="reconcile-ninja")
    api.add_router("/", router)

    class URLConf:
        urlpatterns = [path("api/", api.urls)]

    return URLConf


@pytest.mark.django_db(transaction=True)
def test_a_ninja_operation_s_own_hook_is_found_by_its_route_and_method(alice):
    pytest.importorskip("ninja")
    client = ApiClient(user=alice)
    with override_settings(ROOT_URLCONF=_ninja_urlconf()):
        posted = client.send("POST", "/api/charges/", {}, key="charge")
        patched = client.send("PATCH", "/api/charges/", {}, key="replace")
        assert (posted.status_code, patched.status_code) == (201, 201)
        IdempotencyKey.objects.update(
            state="in_progress", locked_until=timezone.now() - timedelta(seconds=1)
        )
        assert IdempotencyKey.objects.sweep_expired_leases() == 2
        retry = client.send("POST", "/api/charges/", {}, key="charge")
    assert ASKED == [("charge", "api/charges/", 1)]  # the PATCH has no hook: released
    states = dict(IdempotencyKey.objects.values_list("key", "state"))
    assert states == {"charge": "succeeded", "replace": "failed"}
    assert (retry.status_code, json.loads(retry.content)) == (201, {"ninja": True})
    assert retry["Idempotency-Status"] == "replayed"


class TestTheRegistry:
    """The sweeper finds a view's hook in what its adapter registered, through its URL pattern."""

    def test_a_drf_view_declares_its_hook_with_its_class(self):
        from rest_framework import viewsets  # noqa: PLC0415

        class ChargeViewSet(IdempotentMixin, viewsets.ViewSet):
            idempotency_reconcile = "tests.test_reconcile.answer_created"

            def create(self, request):
                return JsonResponse({}, status=201)

        class NoHook(ReconciledLeaseView):
            idempotency_reconcile = None

        assert hooks.hooks_of(ReconciledLeaseView.as_view()) == {None: answer_created}
        # A viewset's view names its class only as DRF's cls: the DRF adapter reads it.
        viewset = ChargeViewSet.as_view({"post": "create"})
        assert hooks.hooks_of(viewset) == {None: "tests.test_reconcile.answer_created"}
        assert hooks.hooks_of(NoHook.as_view()) == {}

    def test_a_plain_view_declares_its_hook_when_decorated(self):
        assert hooks.hooks_of(plain_charge) == {None: "tests.test_reconcile.nothing"}
        # Found behind a decorator that wraps it, as the URLconf may hold it.
        assert hooks.hooks_of(csrf_exempt(plain_charge)) == {None: "tests.test_reconcile.nothing"}

    def test_a_ninja_operation_declares_its_hook_for_its_methods(self):
        pytest.importorskip("ninja")
        with override_settings(ROOT_URLCONF=_ninja_urlconf()):
            assert hooks_by_route() == {("api/charges/", "POST"): ninja_charged}

    def test_an_attribute_stuck_on_a_view_is_no_declaration(self):
        def charge(request):
            return JsonResponse({}, status=201)

        charge.idempotency_reconcile = answer_created  # not through an adapter

        class URLConf:
            urlpatterns = [path("charge/", charge)]

        assert hooks.hooks_of(charge) == {}
        with override_settings(ROOT_URLCONF=URLConf):
            assert hooks_by_route() == {}
