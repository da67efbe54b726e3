"""scale.py's results as Markdown tables, and a plot of throughput and p99 against table size."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.common import millis, plural, ratio, table
from benchmarks.databases import DATABASES
from benchmarks.scale import KEY_SCENARIOS, MILLION, median

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from benchmarks.scale import Results

KEY_HEADER = (
    "keys", "bare req/s", "fresh req/s", "fresh/bare", "fresh p99", "replay req/s", "replay/bare",
    "replay p99", "fresh vs empty", "replay vs empty",
)  # fmt: skip
PURGE_HEADER = (
    "purge", "req/s alone", "req/s during", "p99 alone", "p99 during", "p99 during/alone",
    "deleted", "took", "rows/s", "longest DELETE", "longest read", "dead tuples a minute later",
    "table + indexes",
)  # fmt: skip
WRITTEN_HEADER = (
    "purge", "WAL", "WAL per row deleted", "full-page images", "checkpoints",
    "buffers written by checkpoints", "by backends",
)  # fmt: skip


def megabytes(value: float) -> str:
    return f"{value / 1024 / 1024:,.0f} MB"


def size_label(size: float) -> str:
    return f"{size:g} million" if size else "empty"


def report(results: Results, args: argparse.Namespace) -> str:
    title = DATABASES[results.database].title
    parts = [
        f"`python -m benchmarks.scale --database {results.database}"
        + (" --quick" if args.quick else "")
        + f"`: {title} {DATABASES[results.database].version()}, gunicorn (2 sync workers), "
        f"wrk at 8 connections, median of {plural(args.rounds, 'round')} x {args.duration} s.",
        "",
        f"### Requests against the size of the key table, on {title}",
        "",
        table(
            KEY_HEADER,
            key_rows(results.keys),
        ),
    ]
    if results.upkeep:
        parts += [
            "",
            "Autovacuum on the key table while each size was measured: "
            + "; ".join(
                f"{size:g} million: vacuumed {vacuums}, analyzed {analyzes} times"
                for size, (vacuums, analyzes) in sorted(results.upkeep.items())
            )
            + ".",
        ]
    if results.inbox:
        parts += [
            "",
            f"### Webhook ingest against the size of the inbox, on {title}",
            "",
            "Every event delivered twice (50 % duplicates); the inbox's worker paused.",
            "",
            table(
                ["events", "bare req/s", "inbox req/s", "inbox/bare", "inbox p99", "vs empty"],
                inbox_rows(results.inbox),
            ),
        ]
    parts += ["", f"### What a million rows cost on disk, on {title}", "", disk(results)]
    if results.purges:
        parts += ["", "### Fresh requests during a purge, on PostgreSQL", "", purges(results)]
    parts += [
        "",
        "Fills: "
        + "; ".join(f"{name}: {seconds:,.0f} s" for name, seconds in results.fills.items())
        + ".",
    ]
    return "\n".join(parts)


def key_rows(keys: dict[float, dict[str, list[Any]]]) -> list[list[str]]:
    first = min(keys)
    rows = []
    for size, runs in sorted(keys.items()):
        rps = {scenario: median(runs[scenario], "rps") for scenario in KEY_SCENARIOS}
        rows.append(
            [
                size_label(size),
                f"{rps['bare']:,.0f}",
                f"{rps['fresh']:,.0f}",
                ratio(rps["fresh"] / rps["bare"], bold=False),
                millis(median(runs["fresh"], "p99")),
                f"{rps['replay']:,.0f}",
                ratio(rps["replay"] / rps["bare"], bold=False),
                millis(median(runs["replay"], "p99")),
                ratio(
                    rps["fresh"]
                    / rps["bare"]
                    / (median(keys[first]["fresh"], "rps") / median(keys[first]["bare"], "rps"))
                ),
                ratio(
                    rps["replay"]
                    / rps["bare"]
                    / (median(keys[first]["replay"], "rps") / median(keys[first]["bare"], "rps"))
                ),
            ]
        )
    return rows


def inbox_rows(inbox: dict[float, dict[str, list[Any]]]) -> list[list[str]]:
    first = min(inbox)

    def share(runs: dict[str, list[Any]]) -> float:
        return median(runs["inbox-database"], "rps") / median(runs["bare-webhook"], "rps")

    return [
        [
            size_label(size),
            f"{median(runs['bare-webhook'], 'rps'):,.0f}",
            f"{median(runs['inbox-database'], 'rps'):,.0f}",
            ratio(share(runs), bold=False),
            millis(median(runs["inbox-database"], "p99")),
            ratio(share(runs) / share(inbox[first])),
        ]
        for size, runs in sorted(inbox.items())
    ]


def disk(results: Results) -> str:
    rows = []
    for name, measured in results.disk.items():
        if measured["rows"] < MILLION // 100:  # too few to say (an empty table's reltuples is -1)
            continue
        per_million = MILLION / measured["rows"]
        rows.append([f"`{name}`: the table", megabytes(measured["heap"] * per_million)])
        rows += [
            [f"`{index}`", megabytes(size * per_million)]
            for index, size in measured["indexes"].items()
        ]
        rows.append(
            [
                f"**`{name}` in all** (measured on {measured['rows']:,} rows)",
                megabytes((measured["heap"] + sum(measured["indexes"].values())) * per_million),
            ]
        )
    states = ", ".join(
        f"{state} {size:,.0f} bytes" for state, size in sorted(results.row_bytes.items())
    )
    return (
        table(["per million rows", "on disk"], rows)
        + f"\n\nA key row by its state, on average: {states}."
    )


def purges(results: Results) -> str:
    rows = []
    for purge in results.purges:
        rows.append(
            [
                purge["purge"],
                f"{purge['alone']['rps']:,.0f}",
                f"{purge['during']['rps']:,.0f}",
                millis(purge["alone"]["p99"]),
                millis(purge["during"]["p99"]),
                ratio(purge["during"]["p99"] / purge["alone"]["p99"]),
                f"{purge['deleted']:,}",
                f"{purge['seconds']:,.1f} s",
                f"{purge['deleted'] / max(purge['seconds'], 0.001):,.0f}",
                *(millis(purge["longest"].get(kind, (0.0,))[0] * 1000) for kind in LONGEST),
                f"{purge['dead']:,}" + ("" if purge["vacuumed"] else " (not vacuumed yet)"),
                megabytes(purge["heap"] + purge["index"]),
            ]
        )
    return "\n\n".join([table(PURGE_HEADER, rows), written(results), statements(results)])


LONGEST = ("DELETE", "read")


def written(results: Results) -> str:
    """What the server wrote while each purge ran (the requests beside it included)."""
    rows = []
    for purge in results.purges:
        wrote = purge["written"]
        rows.append(
            [
                purge["purge"],
                megabytes(wrote["wal_bytes"]),
                f"{wrote['wal_bytes'] / max(purge['deleted'], 1):,.0f} bytes",
                f"{wrote['wal_fpi']:,}",
                f"{wrote['checkpoints']:,}",
                f"{wrote['buffers_checkpoint']:,}",
                f"{wrote['buffers_backend']:,}",
            ]
        )
    return "What the server wrote while each purge ran, the traffic beside it included:\n\n" + (
        table(WRITTEN_HEADER, rows)
    )


def statements(results: Results) -> str:
    """The statements of each purge's longest transactions."""
    lines = ["The statements of the longest transactions:", ""]
    for purge in results.purges:
        for kind in LONGEST:
            if kind in purge["longest"]:
                seconds, statement = purge["longest"][kind]
                lines.append(f"- {purge['purge']}, {millis(seconds * 1000)}: `{statement[:160]}`")
    return "\n".join(lines)


def plot(results: Results, args: argparse.Namespace, path: Path) -> None:
    """Throughput and p99 of bare, fresh and replay against the key table's size."""
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = sorted(results.keys)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    for scenario in KEY_SCENARIOS:
        left.plot(
            sizes, [median(results.keys[s][scenario], "rps") for s in sizes], marker="o",
            label=scenario,
        )  # fmt: skip
        right.plot(
            sizes, [median(results.keys[s][scenario], "p99") for s in sizes], marker="o",
            label=scenario,
        )  # fmt: skip
    left.set_ylabel("requests per second")
    right.set_ylabel("p99, ms")
    for axes in (left, right):
        axes.set_xlabel("keys in the table, millions")
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(
        f"POST a payment against the key table's size, {DATABASES[results.database].title}: "
        f"wrk, 8 connections, median of {plural(args.rounds, 'round')} x {args.duration} s",
        fontsize="medium",
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
