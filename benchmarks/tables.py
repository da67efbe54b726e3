"""run.py's results as Markdown tables, and its sweep as a plot."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from benchmarks.common import millis, plural, ratio, table
from benchmarks.databases import DATABASES
from benchmarks.run import (
    AT_REST_EVENTS,
    REQUEST_SCENARIOS,
    SWEEP_SCENARIOS,
    WEBHOOK_SCENARIOS,
    worker_threads,
)

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from benchmarks.run import Measure, Results, Runs

# How the tables and the plot name the scenarios.
LABELS = {
    "bare": "`bare`",
    "fresh": "`fresh` (new key each time)",
    "replay": "`replay` (same key each time)",
    "naive-fresh": "`naive-fresh`: the naive floor, new key each time",
    "naive-replay": "`naive-replay`: the naive floor, same key each time",
    "cached-fresh": "`cached-fresh`: with the replay cache (Redis), new key each time",
    "cached-replay": "`cached-replay`: with the replay cache (Redis), same key each time",
    "naive-cached-replay": "`naive-cached-replay`: the naive floor behind the same Redis",
    "bare-webhook": "`bare-webhook`: parse the body, insert it into a table",
    "naive-webhook": "`naive-webhook`: the naive floor: verify, insert once by the event's id",
    "inbox": "`inbox`: verify (Stripe scheme), record once, hand to Celery",
    "inbox-inline": "`inbox-inline`: the same, then run the handler in the request",
    "inbox-database": "`inbox-database`: the same, record only (the worker paused)",
    "inbox-database-worker": "`inbox-database-worker`: the same, its worker running beside",
    "async-bare": "`async-bare`: the async view without `@idempotent`",
    "async-fresh": "`async-fresh`: the async view, new key each time",
    "async-replay": "`async-replay`: the async view, same key each time",
}
PLOT_LABELS = {
    "bare": "bare view (no idempotency)",
    "fresh": "idempotent, a new key each time",
    "replay": "idempotent, replays (same key)",
}


def median(runs: list[Measure]) -> Measure:
    """The median of each figure over ``runs``."""
    return {metric: statistics.median(run[metric] for run in runs) for metric in runs[0]}


def workers_text(args: argparse.Namespace) -> str:
    """``2 gunicorn sync workers``, ``4 gunicorn gthread workers x 4 threads``."""
    if args.worker_class == "sync":
        return f"{plural(args.workers, 'gunicorn sync worker')}"
    return f"{plural(args.workers, 'gunicorn gthread worker')} x {worker_threads(args)} threads"


def scenario_table(rounds: Runs, names: tuple[str, ...]) -> str:
    """Median req/s, p50 and p99 of ``names``, each also as a ratio of the first (the bare)."""
    medians = {name: median(rounds[name]) for name in names}
    bare = medians[names[0]]
    header = ["scenario", "req/s", "req/s vs bare", "p50", "p50 vs bare", "p99", "p99 vs bare"]
    rows = [
        [
            LABELS[name],
            f"{row['rps']:,.0f}",
            ratio(row["rps"] / bare["rps"], bold=name != names[0]),
            millis(row["p50"]),
            ratio(row["p50"] / bare["p50"], bold=name != names[0]),
            millis(row["p99"]),
            ratio(row["p99"] / bare["p99"], bold=name != names[0]),
        ]
        for name, row in medians.items()
    ]
    return table(header, rows)


def requests_section(results: Results, args: argparse.Namespace) -> str:
    return (
        f"{plural(args.rounds, 'round')} x {args.duration} s after a warm-up round, "
        f"{args.connections} connections, {workers_text(args)}; medians of the rounds. Every "
        "round checked that `fresh`, `naive-fresh` and `cached-fresh` stored one payment and one "
        "key per request, and that the replays stored none.\n\n"
        + scenario_table(results.rounds, REQUEST_SCENARIOS)
    )


def webhooks_section(results: Results, args: argparse.Namespace) -> str:
    return (
        "Signed `refund.succeeded` events, each delivered twice (50% duplicates), in the same "
        "rounds; every round checked that the inbox (and the naive floor) recorded one event per "
        "two requests. Each "
        "runner has its own gunicorn. The `database` runner's one worker "
        "(`idempotency_inbox --forever`) runs on the same cores; during `inbox-database` it is "
        "paused (SIGSTOP), so that the figure is the ingest's alone.\n\n"
        + scenario_table(results.rounds, WEBHOOK_SCENARIOS)
        + "\n\nProcessing latency, from the event's recording to its handler's commit "
        "(`processed_at - received_at`). Under load: every event of the round, medians of the "
        "rounds; each round waited until every event was processed, so an event also waits for "
        f"those recorded before it. At rest: {AT_REST_EVENTS} events after the rounds, each sent "
        "once the one before was processed:\n\n" + latency_table(results)
    )


def latency_table(results: Results) -> str:
    names = [name for name in WEBHOOK_SCENARIOS if "latency_p50" in results.rounds[name][0]]
    rows = []
    for name in names:
        row = [LABELS[name]]
        under_load = median(results.rounds[name])
        row += [millis(under_load["latency_p50"]), millis(under_load["latency_p95"])]
        at_rest = results.at_rest.get(name)
        if at_rest is None:
            row += ["", ""]
        else:
            row += [millis(at_rest["latency_p50"]), millis(at_rest["latency_max"])]
        rows.append(row)
    header = ["scenario", "under load, p50", "p95", "at rest, p50", "max"]
    return table(header, rows)


def bursts_section(results: Results, args: argparse.Namespace) -> str:
    rows = []
    for number, result in enumerate(results.bursts, 1):
        counts = result["answers"].most_common()
        answers = ", ".join(f"{n} × `{answer}`" for answer, n in counts)  # noqa: RUF001
        payments = "payment" if result["effects"] == 1 else "payments"
        rows.append(
            [
                str(number),
                f"**{result['effects']}** {payments}",
                answers,
                f"{result['seconds']:.2f} s",
            ]
        )
    return (
        f"{args.burst} identical `POST`s with one key at the same instant, once a round:\n\n"
        + table(["run", "effects", "answers", "time to the last answer"], rows)
    )


def sweep_section(results: Results, args: argparse.Namespace) -> str:
    medians = {
        scenario: {level: median(runs) for level, runs in by_level.items()}
        for scenario, by_level in results.sweep.items()
    }
    header = ["connections"]
    header += [f"`{scenario}` req/s" for scenario in SWEEP_SCENARIOS]
    header += [f"`{scenario}` vs `bare`" for scenario in SWEEP_SCENARIOS[1:]]
    rows = []
    for level in args.sweep:
        bare = medians["bare"][level]["rps"]
        row = [str(level)]
        row += [f"{medians[scenario][level]['rps']:,.0f}" for scenario in SWEEP_SCENARIOS]
        row += [
            ratio(medians[scenario][level]["rps"] / bare, bold=False)
            for scenario in SWEEP_SCENARIOS[1:]
        ]
        rows.append(row)
    return (
        f"`bare`, `fresh` and `replay` at each number of connections, "
        f"{plural(args.rounds, 'round')} x {args.sweep_duration} s alternated, medians:\n\n"
        + table(header, rows)
    )


def during_purge_section(results: Results, args: argparse.Namespace) -> str:
    medians = {name: median(runs) for name, runs in results.during_purge.items()}
    alone = medians["alone"]
    rows = [
        [
            name,
            f"{row['rps']:,.0f}",
            millis(row["p50"]),
            millis(row["p99"]),
            ratio(row["p99"] / alone["p99"], bold=name != "alone"),
        ]
        for name, row in medians.items()
    ]
    seconds = ", ".join(f"{purge['seconds']:.1f}" for purge in results.purges)
    longest = ", ".join(f"{purge['longest_batch'] * 1000:,.0f}" for purge in results.purges)
    return (
        f"Fresh idempotent `POST`s, alone and while a purge throttled with `pause=0.05` deletes "
        f"{args.purge_rows:,} expired keys from the same table, {plural(args.rounds, 'round')} x "
        f"{args.duration} s alternated, medians. The purge took {seconds} s, its longest batch "
        f"{longest} ms.\n\n" + table(["", "req/s", "p50", "p99", "p99 vs alone"], rows)
    )


def report(results: Results, args: argparse.Namespace, level: int = 2, suffix: str = "") -> str:
    """Every table, with a heading each, of Markdown's ``level``; ``suffix`` after its subject."""
    sections = {
        "Requests: idempotent view against the same bare view": requests_section,
        "Webhooks: the inbox against a view that only inserts the row": webhooks_section,
        "A burst of one key": bursts_section,
    }
    if results.sweep:
        sections["Throughput against concurrency"] = sweep_section
    if results.during_purge:
        sections["Requests during a purge"] = during_purge_section
    return "\n\n".join(
        f"{'#' * level} {heading(title, args.database, suffix)}\n\n{section(results, args)}"
        for title, section in sections.items()
    )


def heading(title: str, database: str, suffix: str = "") -> str:
    """``title`` as is on PostgreSQL, else naming the server: ``Requests on MariaDB: ...``."""
    subject, colon, rest = title.partition(":")
    if database != "postgresql":
        suffix = f" on {DATABASES[database].title}{suffix}"
    return f"{subject}{suffix}{colon}{rest}"


def plot(results: Results, args: argparse.Namespace, path: Path) -> None:
    """Draw the sweep's median requests per second against connections into the PNG ``path``."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    for scenario in SWEEP_SCENARIOS:
        levels = sorted(results.sweep[scenario])
        rates = [median(results.sweep[scenario][level])["rps"] for level in levels]
        axes.plot(levels, rates, marker="o", label=PLOT_LABELS[scenario])
    axes.set_xscale("log", base=2)
    axes.set_xticks(args.sweep, [str(level) for level in args.sweep])
    axes.minorticks_off()
    axes.set_ylim(bottom=0)
    axes.set_xlabel("concurrent connections")
    axes.set_ylabel("requests per second")
    axes.set_title(
        f"POST a payment: {workers_text(args)}, "
        f"{DATABASES[args.database].title}\n"
        f"median of {plural(args.rounds, 'round')} x {args.sweep_duration} s",
        fontsize="medium",
    )
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
