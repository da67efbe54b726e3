"""The Grafana dashboard and the Prometheus alerts in deploy/: they ask only for series that a
scrape of the library really returns, with the labels those series really have, and the alerts
pass promtool's check and their own unit tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from django_idempotency import signals
from django_idempotency.client import CircuitBreakers, RetryBudgets, RetryPolicy, RetryTransport
from django_idempotency.core import outcomes
from django_idempotency.models import IdempotencyKey, InboxEvent
from tests.conftest import CI

# The files mean the same whatever the database: they are checked once, in the SQLite pass.
if os.environ.get("TEST_DATABASE", "sqlite") != "sqlite":
    pytest.skip("the deploy files are checked in the SQLite pass", allow_module_level=True)
# A scrape counts the backlog in the database: the test database must exist, empty is enough.
pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DASHBOARD = ROOT / "deploy" / "grafana" / "django-idempotency.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts-test.yml"

PREFIX = "django_idempotency_"
# Prometheus adds these to every series it scrapes.
TARGET_LABELS = frozenset({"job", "instance"})
PANEL_TYPES = {"row", "timeseries", "stat", "table"}
SEVERITIES = {"warning", "critical"}
# A link to a section of the docs: docs/operations.md#dead-events.
DOCS_LINK = r"docs/([\w/-]+\.md)#([\w-]+)"
GRID_WIDTH = 24


# --- what a scrape returns ------------------------------------------------------------------


def exercise_every_family() -> RetryPolicy:
    """Give each labelled family a sample: a family without one shows no labels in a scrape.

    The decisions, inbox steps, refusals, tasks, leases, replay cache errors and unroutable
    broker messages are counted by the library's own receivers of its signals; the retry client
    runs for real, against a host that fails once. The policy returned holds the host's circuit
    breaker, which the scrape reports only while it lives.
    """
    signals.key_replayed.send(
        sender=None,
        request=None,
        key="deploy-key",
        scope="deploy",
        route="deploy/",
        response=None,
        outcome="replayed",
        attempt=2,
        overhead=0.001,
    )
    signals.inbox_event_received.send(sender=InboxEvent, event=InboxEvent(source="deploy"))
    signals.inbox_delivery_refused.send(
        sender=None, source="deploy", reason="inbox.signature_invalid"
    )
    signals.task_decided.send(
        sender=None,
        task="deploy.task",
        key="deploy-key",
        scope="deploy",
        outcome="stored",
        attempt=1,
        error=None,
    )
    signals.lease_renewed.send(sender=IdempotencyKey, key="deploy-key")
    signals.lease_taken_over.send(
        sender=IdempotencyKey, key="deploy-key", scope="deploy", route="deploy/"
    )
    signals.replay_cache_failed.send(sender="idempotency", operation="get", error=OSError())
    outcomes.report_unroutable("deploy-events", "deploy.happened")
    answers = [httpx.Response(503), httpx.Response(200)]
    policy = RetryPolicy(
        breaker=CircuitBreakers(),
        budget=RetryBudgets(),
        sleep=lambda seconds: None,
        random=lambda: 0.5,
    )
    transport = RetryTransport(httpx.MockTransport(lambda request: answers.pop(0)), policy)
    with httpx.Client(transport=transport) as session:
        assert session.get("http://deploy.test/").status_code == 200
    return policy


@pytest.fixture(scope="module")
def scrape(django_db_setup, django_db_blocker) -> str:
    """The library's metrics as Prometheus scrapes them, from the registry they are in."""
    policy = exercise_every_family()
    # The backlog gauges are counted in the database at each scrape: here, in the empty test one.
    with django_db_blocker.unblock():
        text = generate_latest(REGISTRY).decode()
    del policy  # its circuit breaker had to outlive the scrape
    return text


@pytest.fixture(scope="module")
def exported(scrape) -> dict[str, frozenset[str]]:
    """Each of the library's series names in the scrape (``…_total``, ``…_bucket``): its labels."""
    series: dict[str, frozenset[str]] = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            if sample.name.startswith(PREFIX):
                series[sample.name] = series.get(sample.name, frozenset()) | set(sample.labels)
    return series


def test_the_scrape_has_a_sample_of_every_family(scrape, exported):
    families = [f for f in text_string_to_metric_families(scrape) if f.name.startswith(PREFIX)]
    assert [family.name for family in families if not family.samples] == []
    # The counters, the histograms, the backlog gauges and the circuits are all there.
    for name in (
        "django_idempotency_requests_total",
        "django_idempotency_overhead_seconds_bucket",
        "django_idempotency_inbox_dead_events",
        "django_idempotency_inbox_oldest_due_seconds",
        "django_idempotency_outbox_oldest_due_seconds",
        "django_idempotency_lease_renewals_total",
        "django_idempotency_lease_takeovers_total",
        "django_idempotency_replay_cache_errors_total",
        "django_idempotency_scrape_errors_total",
        "django_idempotency_client_circuits",
    ):
        assert name in exported


# --- reading PromQL ---------------------------------------------------------------------------


class QueryError(ValueError):
    pass


# What a (sub)expression gives: an instant or range vector (the label names its series have), a
# scalar or a string.
SCALAR = "scalar"
STRING = "string"

AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar"}
AGGREGATIONS_WITH_PARAMETER = {"topk", "bottomk", "quantile"}
# Functions whose result keeps the labels of their vector argument, and the others.
LABEL_KEEPING_FUNCTIONS = {
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "deriv",
    "changes",
    "resets",
    "min_over_time",
    "max_over_time",
    "avg_over_time",
    "sum_over_time",
    "count_over_time",
    "last_over_time",
    "quantile_over_time",
    "abs",
    "ceil",
    "floor",
    "round",
    "clamp",
    "clamp_min",
    "clamp_max",
    "sqrt",
    "ln",
    "exp",
    "timestamp",
}
FUNCTIONS = {*LABEL_KEEPING_FUNCTIONS, "histogram_quantile", "vector", "scalar", "time"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
BINARY = {
    "or": 1,
    "and": 2,
    "unless": 2,
    "==": 3,
    "!=": 3,
    "<": 3,
    "<=": 3,
    ">": 3,
    ">=": 3,
    "+": 4,
    "-": 4,
    "*": 5,
    "/": 5,
    "%": 5,
    "^": 6,
}
MATCHERS = {"=", "!=", "=~", "!~"}
# A duration, or one of Grafana's variables that stand for one ($__rate_interval, ${__range}).
DURATION = r"(?:\d+(?:ms|[smhdwy]))+|\$__\w+|\$\{__\w+\}"
RANGE = re.compile(rf"\[\s*(?:{DURATION})\s*(?::\s*(?:{DURATION})?\s*)?\]")
TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
      | (?P<range>\[[^\]]*\])
      | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){},])
    )\s*""",
    re.VERBOSE,
)


def tokenize(query: str) -> list[tuple[str, str]]:
    tokens, position = [], 0
    while position < len(query):
        match = TOKEN.match(query, position)
        if match is None or match.end() == position:
            raise QueryError(f"cannot read {query[position:]!r}")
        position = match.end()
        kind = match.lastgroup
        assert kind is not None
        if kind == "range" and not RANGE.fullmatch(match[kind]):
            raise QueryError(f"not a range or subquery: {match[kind]}")
        tokens.append((kind, match[kind]))
    return tokens


class Query:
    """A PromQL expression read for what it asks of the metrics: the series it selects, the
    labels it matches, groups and joins on; it raises ``QueryError`` on anything else."""

    def __init__(self, text: str, exported: dict[str, frozenset[str]]) -> None:
        self.exported = exported
        self.tokens = tokenize(text)
        self.position = 0
        self.series: set[str] = set()
        # The labels of the expression's result; SCALAR or STRING for those.
        self.labels = self.expression(0)
        if self.position != len(self.tokens):
            raise QueryError(f"unexpected {self.peek()[1]!r}")

    # The tokens.

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.position] if self.position < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token[0] == "end":
            raise QueryError("the query ends too soon")
        self.position += 1
        return token

    def accept(self, value: str) -> bool:
        if self.peek()[1] == value and self.peek()[0] in ("op", "ident"):
            self.position += 1
            return True
        return False

    def expect(self, value: str) -> None:
        if not self.accept(value):
            raise QueryError(f"expected {value!r}, found {self.peek()[1]!r}")

    def label_list(self) -> frozenset[str]:
        self.expect("(")
        labels = set()
        while not self.accept(")"):
            kind, name = self.take()
            if kind != "ident":
                raise QueryError(f"not a label name: {name!r}")
            labels.add(name)
            if self.peek()[1] != ")":
                self.expect(",")
        return frozenset(labels)

    def check(self, labels: frozenset[str], available: frozenset[str], where: str) -> None:
        if unknown := labels - available:
            raise QueryError(f"{where}: no label {sorted(unknown)} there, only {sorted(available)}")

    # The grammar.

    def expression(self, precedence: int) -> frozenset[str] | str:
        left = self.unary()
        while (operator := self.peek()[1]) in BINARY and BINARY[operator] >= precedence:
            self.take()
            self.accept("bool")
            matching = group = None
            if self.peek()[1] in ("on", "ignoring"):
                matching = (self.take()[1], self.label_list())
            if self.peek()[1] in ("group_left", "group_right"):
                side = self.take()[1]
                group = (side, self.label_list() if self.peek()[1] == "(" else frozenset())
            # ^ is right-associative, the others left-associative.
            right = self.expression(BINARY[operator] + (operator != "^"))
            left = self.combine(operator, left, right, matching, group)
        return left

    def combine(self, operator, left, right, matching, group) -> frozenset[str] | str:
        if STRING in (left, right):
            raise QueryError(f"a string on a side of {operator!r}")
        vectors = [side for side in (left, right) if side != SCALAR]
        if len(vectors) < 2:
            if matching or group:
                raise QueryError(f"{operator!r} matches labels but has a scalar side")
            return vectors[0] if vectors else SCALAR
        if matching is None:
            if left != right:
                sides = f"{sorted(left)} with {sorted(right)}"
                raise QueryError(f"{operator!r} matches {sides}: say on() or ignoring()")
        elif matching[0] == "on":
            self.check(matching[1], left & right, f"{operator} on")
        else:
            self.check(matching[1], left | right, f"{operator} ignoring")
        if group is not None:
            many, one = (left, right) if group[0] == "group_left" else (right, left)
            self.check(group[1], one, group[0])
            return many | group[1]
        return left | right if operator == "or" else left

    def unary(self) -> frozenset[str] | str:
        if self.accept("-") or self.accept("+"):
            return self.unary()
        result = self.primary()
        if self.peek()[0] == "range":
            self.take()  # a range of a selector, or a subquery of an expression
        return result

    def primary(self) -> frozenset[str] | str:
        kind, value = self.take()
        if kind == "number":
            return SCALAR
        if kind == "string":
            return STRING
        if value == "(":
            inner = self.expression(0)
            self.expect(")")
            return inner
        if kind != "ident" or value in KEYWORDS or value in BINARY:
            raise QueryError(f"unexpected {value!r}")
        if value in AGGREGATIONS | AGGREGATIONS_WITH_PARAMETER:
            return self.aggregation(value)
        if self.peek()[1] == "(":
            return self.function(value)
        return self.selector(value)

    def aggregation(self, name: str) -> frozenset[str]:
        grouping = self.grouping()
        arguments = self.arguments()
        if grouping is None:
            grouping = self.grouping()
        expected = 2 if name in AGGREGATIONS_WITH_PARAMETER else 1
        inner = arguments[-1]
        if len(arguments) != expected or inner in (SCALAR, STRING):
            raise QueryError(f"{name}() takes {expected} arguments, the last a vector")
        if grouping is None:
            return frozenset()
        keyword, labels = grouping
        self.check(labels, inner, f"{name} {keyword}")
        return labels if keyword == "by" else inner - labels

    def grouping(self) -> tuple[str, frozenset[str]] | None:
        if self.peek()[1] in ("by", "without"):
            return self.take()[1], self.label_list()
        return None

    def arguments(self) -> list[frozenset[str] | str]:
        self.expect("(")
        arguments = [self.expression(0)]
        while self.accept(","):
            arguments.append(self.expression(0))
        self.expect(")")
        return arguments

    def function(self, name: str) -> frozenset[str] | str:
        if name not in FUNCTIONS:
            raise QueryError(f"{name}() is not a function this reader knows")
        if name == "time":
            self.expect("(")
            self.expect(")")
            return SCALAR
        arguments = self.arguments()
        vectors = [argument for argument in arguments if argument not in (SCALAR, STRING)]
        if name == "vector":
            return frozenset()
        if not vectors:
            raise QueryError(f"{name}() without a vector")
        if name == "scalar":
            return SCALAR
        if name == "histogram_quantile":
            self.check(frozenset({"le"}), vectors[0], "histogram_quantile")
            return vectors[0] - {"le"}
        return vectors[0]

    def selector(self, name: str) -> frozenset[str]:
        if name not in self.exported:
            raise QueryError(f"{name} is not a series the library exports")
        self.series.add(name)
        labels = self.exported[name] | TARGET_LABELS
        if self.accept("{"):
            while not self.accept("}"):
                kind, label = self.take()
                if kind != "ident":
                    raise QueryError(f"not a label name: {label!r}")
                self.check(frozenset({label}), labels, name)
                if self.take()[1] not in MATCHERS or self.take()[0] != "string":
                    raise QueryError(f"{name}: {label} needs a matcher and a quoted value")
                if self.peek()[1] != "}":
                    self.expect(",")
        return labels


def read(query: str, exported: dict[str, frozenset[str]]) -> Query:
    """Read ``query``; every name that looks like one of the library's must be one it exports."""
    for name in re.findall(rf"\b{PREFIX}\w*", query):
        if name not in exported:
            raise QueryError(f"{name} is not a series the library exports")
    return Query(query, exported)


def read_label_values(query: str, exported: dict[str, frozenset[str]]) -> Query:
    """Read a Grafana variable's ``label_values(selector, label)``."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query, re.DOTALL)
    if match is None:
        raise QueryError(f"not label_values(selector, label): {query}")
    selector = read(match[1], exported)
    assert isinstance(selector.labels, frozenset)
    selector.check(frozenset({match[2]}), selector.labels, "label_values")
    return selector


def placeholders(template: str, pattern: str) -> frozenset[str]:
    return frozenset(re.findall(pattern, template))


@pytest.mark.parametrize(
    ("query", "labels"),
    [
        ("sum by (outcome) (rate(django_idempotency_requests_total[5m]))", {"outcome"}),
        ("sum(rate(django_idempotency_requests_total[5m])) by (route)", {"route"}),
        (
            "sum without (route) (django_idempotency_requests_total)",
            {"outcome", "job", "instance"},
        ),
        (
            "histogram_quantile(0.99, sum by (le, outcome)"
            " (rate(django_idempotency_overhead_seconds_bucket[5m])))",
            {"outcome"},
        ),
        (
            "max by (job) (django_idempotency_stuck_leases - django_idempotency_unsettled_leases)",
            {"job"},
        ),
        (
            "sum by (job, host) (django_idempotency_client_circuits) > 0 and on (job, host)"
            " sum by (job, host) (rate(django_idempotency_client_circuit_rejected_total[5m])) > 0",
            {"job", "host"},
        ),
        ("min_over_time(django_idempotency_inbox_due_events[10m:1m]) > bool 0", TARGET_LABELS),
    ],
)
def test_the_reader_follows_the_labels_of_a_query(exported, query, labels):
    assert read(query, exported).labels == labels


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("rate(django_idempotency_requests[5m])", "django_idempotency_requests is not"),
        ("rate(django_idempotency_requests_total_count[5m])", "is not a series"),
        ("django_idempotency_overhead_seconds", "is not a series"),
        ('django_idempotency_requests_total{outcom="stored"}', r"no label \['outcom'\]"),
        ("sum by (host) (django_idempotency_requests_total)", r"sum by: no label \['host'\]"),
        ("sum(django_idempotency_tasks_total) by (route)", r"no label \['route'\]"),
        (
            "histogram_quantile(0.9, sum by (outcome)"
            " (rate(django_idempotency_overhead_seconds_bucket[5m])))",
            r"histogram_quantile: no label \['le'\]",
        ),
        ("sum(django_idempotency_overhead_seconds_count{le='1'})", r"no label \['le'\]"),
        (
            "django_idempotency_stuck_leases / on (host) django_idempotency_unsettled_leases",
            r"on: no label \['host'\]",
        ),
        (
            "sum by (outcome) (django_idempotency_requests_total)"
            " / sum(django_idempotency_requests_total)",
            "say on",
        ),
        ("up", "up is not a series"),
        ("sum(rate(up[5m]))", "up is not a series"),
        ("label_replace(django_idempotency_stuck_leases, 'a', 'b', 'c', 'd')", "not a function"),
        ("rate(django_idempotency_requests_total[$job])", "not a range"),
        ('django_idempotency_stuck_leases{job=~"$job"} > $threshold', "cannot read"),
        ("{__name__=~'django_idempotency_.*'}", "is not a series"),
        ("sum(django_idempotency_stuck_leases", r"expected '\)'"),
        ("django_idempotency_stuck_leases offset 5m", "unexpected 'offset'"),
    ],
)
def test_the_reader_refuses_what_the_library_does_not_export(exported, query, error):
    with pytest.raises(QueryError, match=error):
        read(query, exported)


# --- the dashboard ----------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def values_of(node: object, key: str) -> list[object]:
    """Every value of ``key`` anywhere in a JSON document."""
    if isinstance(node, list):
        return [value for item in node for value in values_of(item, key)]
    if isinstance(node, dict):
        own = [node[key]] if key in node else []
        return own + [value for item in node.values() for value in values_of(item, key)]
    return []


def all_panels(panels: list[dict]) -> list[dict]:
    """Every panel, with those inside a collapsed row."""
    return [inner for panel in panels for inner in [panel, *all_panels(panel.get("panels", []))]]


def dashboard_queries() -> list[pytest.param]:
    return [
        pytest.param(target["expr"], target.get("legendFormat", ""), id=f"{panel['title']} {ref}")
        for panel in all_panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
        for ref in [target["refId"]]
    ]


def dashboard_variables() -> list[pytest.param]:
    """The queries of the variables: as shown (``definition``) and as run (``query``)."""
    return [
        pytest.param(query, id=f"{variable['name']} {field}")
        for variable in load_dashboard()["templating"]["list"]
        if variable["type"] == "query"
        for field, query in (
            ("definition", variable["definition"]),
            ("query", variable["query"]["query"]),
        )
    ]


def test_the_dashboard_asks_for_a_prometheus_datasource_when_imported():
    dashboard = load_dashboard()
    (wanted,) = dashboard["__inputs"]
    assert (wanted["type"], wanted["pluginId"]) == ("datasource", "prometheus")
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    chosen = variables["datasource"]
    assert (chosen["type"], chosen["query"]) == ("datasource", "prometheus")
    assert chosen["current"]["value"] == "${" + wanted["name"] + "}"
    # Every panel, query and variable asks the datasource chosen, none the author's own.
    panels = [panel for panel in all_panels(dashboard["panels"]) if panel["type"] != "row"]
    targets = [target for panel in panels for target in panel["targets"]]
    queried = [variable for variable in variables.values() if variable["type"] == "query"]
    for item in [*panels, *targets, *queried]:
        assert item["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_the_dashboard_has_a_fixed_uid_and_well_formed_panels():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "django-idempotency"
    assert dashboard["id"] is None
    assert 36 <= dashboard["schemaVersion"] <= 41
    panels = all_panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    assert {panel["type"] for panel in panels} <= PANEL_TYPES
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= GRID_WIDTH, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
        if panel["type"] != "row":
            refs = [target["refId"] for target in panel["targets"]]
            assert refs, f"{panel['title']} has no query"
            assert len(refs) == len(set(refs)), panel["title"]
    # No query hides where the tests below do not look.
    queries = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    assert sorted(values_of(dashboard, "expr")) == sorted(queries)


@pytest.mark.parametrize(("query", "legend"), dashboard_queries())
def test_a_panel_asks_only_for_exported_series_and_labels(exported, query, legend):
    read_query = read(query, exported)
    assert read_query.series
    assert isinstance(read_query.labels, frozenset)
    # A legend can only name a label that the query's result keeps.
    assert placeholders(legend, r"\{\{\s*(\w+)\s*\}\}") <= read_query.labels


@pytest.mark.parametrize("query", dashboard_variables())
def test_a_variable_asks_only_for_exported_series_and_labels(exported, query):
    assert read_label_values(query, exported).series


# --- the alerts -------------------------------------------------------------------------------


def load_alerts() -> list[dict]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def slug(heading: str) -> str:
    """The anchor the docs site gives a heading (Python-Markdown's toc extension)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return {slug(heading) for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.MULTILINE)}


@pytest.mark.parametrize("rule", load_alerts(), ids=lambda rule: rule["alert"])
def test_an_alert_asks_only_for_exported_series_and_labels(exported, rule):
    read_query = read(rule["expr"], exported)
    assert isinstance(read_query.labels, frozenset)
    for text in rule["annotations"].values():
        assert placeholders(text, r"\$labels\.(\w+)") <= read_query.labels


@pytest.mark.parametrize("rule", load_alerts(), ids=lambda rule: rule["alert"])
def test_an_alert_says_how_urgent_it_is_and_where_to_read_what_to_do(rule):
    assert re.fullmatch(r"\d+[smh]", rule["for"])
    assert rule["labels"]["severity"] in SEVERITIES
    assert rule["annotations"]["summary"]
    assert re.search(DOCS_LINK, rule["annotations"]["description"]), "it points to no docs"


@pytest.mark.parametrize("path", [DASHBOARD, ALERTS, ALERT_TESTS], ids=lambda path: path.name)
def test_every_docs_link_in_the_deploy_files_leads_to_a_heading(path):
    for page, anchor in re.findall(DOCS_LINK, path.read_text()):
        assert (DOCS / page).is_file(), page
        assert anchor in anchors(DOCS / page), f"{page} has no heading #{anchor}"


def test_every_alert_has_tests_where_it_fires_and_where_it_does_not():
    alerts = {rule["alert"] for rule in load_alerts()}
    cases = [
        case
        for group in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in group.get("alert_rule_test", [])
    ]
    assert {case["alertname"] for case in cases} == alerts
    assert {case["alertname"] for case in cases if case["exp_alerts"]} == alerts
    assert {case["alertname"] for case in cases if not case["exp_alerts"]} == alerts


@pytest.fixture
def promtool() -> str:
    if (executable := shutil.which("promtool")) is None:
        if CI:
            pytest.fail("promtool is missing (it comes with Prometheus), and CI=true needs it")
        pytest.skip("needs promtool, which comes with Prometheus")
    return executable


def run(command: list[str]) -> str:
    completed = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


def test_promtool_accepts_the_rules(promtool):
    assert f"{len(load_alerts())} rules found" in run([promtool, "check", "rules", str(ALERTS)])


def test_the_rules_pass_their_promtool_tests(promtool):
    assert "SUCCESS" in run([promtool, "test", "rules", str(ALERT_TESTS)])
