"""The package's import picture: its rooms, its floors, and every import that runs back up.

``python -m tests.layers`` prints it. A *room* is a package (``core``, ``inbox``...) or, for the
top-level modules, the group they belong to. A *floor* is a layer of the house, lowest first: a
module may import modules of its own floor or below, never above. Every import counts, those
inside functions too (grimp reads them all), and so does a look-up of the package's models in
the app registry, which the graph cannot see.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import grimp

import django_idempotency

PACKAGE = "django_idempotency"

# Lowest first. A module is on the floor of the first pattern it matches (relative to the
# package, "." for the package itself); a module on no floor is an error: place it.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    (
        "ground: settings, signals, exceptions, keys, problems, policies",
        (
            ".",
            "backoff",
            "conf",
            "exceptions",
            "signals",
            "problems",
            "keys",
            "scope",
            "policy",
            "signing",
        ),
    ),
    (
        "core helpers: text, hashes, responses, SQL, correlation ids, hook answers, guard",
        (
            "core",
            "core.text",
            "core.canonical",
            "core.counting",
            "core.databases",
            "core.transactions",
            "core.middleware",
            "core.optional",
            "core.correlation",
            "core.deprecation",
            "core.bodies",
            "core.fingerprint",
            "core.responses",
            "core.statements",
            "core.purging",
            "core.task_sending",
            "core.openapi_contract",
            "core.tables",
            "reconcile",
            "guard",
        ),
    ),
    ("core: the key store and the engine", ("core.*",)),
    ("queue and models", ("queue", "queue.*", "models", "managers")),
    (
        "features: inbox, outbox, brokers, client",
        ("inbox", "inbox.*", "outbox", "outbox.*", "brokers", "brokers.*", "client", "client.*"),
    ),
    (
        "entry points: adapters, public modules, operations, admin, commands, app config",
        ("*",),
    ),
]

ROOMS = (
    "admin",
    "brokers",
    "client",
    "core",
    "django_tasks",
    "inbox",
    "management",
    "operations",
    "outbox",
    "queue",
)
_MODELS = f"{PACKAGE}.models"
_LOOKUP = re.compile(r"get_(?:model|app_config)\(\s*['\"]django_idempotency")


def short(module: str) -> str:
    return module.removeprefix(f"{PACKAGE}.") if module != PACKAGE else "."


def floor_of(module: str) -> int:
    name = short(module)
    for number, (_, patterns) in enumerate(FLOORS):
        if any(fnmatchcase(name, pattern) for pattern in patterns):
            return number
    msg = f"{module} is on no floor"  # pragma: no cover - the last floor takes everything
    raise LookupError(msg)  # pragma: no cover


def room_of(module: str) -> str:
    head = short(module).split(".")[0]
    if head in ROOMS:
        return head
    return "top level: " + FLOORS[floor_of(module)][0].split(":")[0]


def build_graph() -> grimp.ImportGraph:
    # Imports under TYPE_CHECKING never run: two modules may name each other's types.
    return grimp.build_graph(
        PACKAGE, include_external_packages=True, exclude_type_checking_imports=True, cache_dir=None
    )


@dataclass(frozen=True, order=True)
class Arrow:
    importer: str
    imported: str

    @property
    def back_up(self) -> bool:
        return floor_of(self.importer) < floor_of(self.imported)


def modules(graph: grimp.ImportGraph) -> list[str]:
    return sorted(
        module
        for module in {PACKAGE, *graph.find_descendants(PACKAGE)}
        if "migrations" not in module
    )


def registry_lookups() -> list[str]:
    """The modules that look the package's models up in the app registry."""
    package = Path(django_idempotency.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if "migrations" in path.parts or not _LOOKUP.search(path.read_text()):
            continue
        parts = path.relative_to(package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        found.append(".".join((PACKAGE, *parts)))
    return found


def arrows(graph: grimp.ImportGraph) -> list[Arrow]:
    inside = set(modules(graph))
    found = {
        Arrow(importer, imported)
        for importer in inside
        for imported in graph.find_modules_directly_imported_by(importer) & inside
    }
    found |= {Arrow(importer, _MODELS) for importer in registry_lookups() if importer != _MODELS}
    return sorted(found)


def back_up(graph: grimp.ImportGraph) -> list[Arrow]:
    return [arrow for arrow in arrows(graph) if arrow.back_up]


def picture(graph: grimp.ImportGraph) -> str:
    everything = modules(graph)
    all_arrows = arrows(graph)
    wrong = [arrow for arrow in all_arrows if arrow.back_up]
    rooms: dict[str, list[str]] = {}
    for module in everything:
        rooms.setdefault(room_of(module), []).append(short(module))
    lines = ["Floors, lowest first:"]
    for number, (name, _) in enumerate(FLOORS):
        on_floor = [short(module) for module in everything if floor_of(module) == number]
        lines.append(f"  {number} {name} ({len(on_floor)}): {' '.join(on_floor)}")
    lines.append("Rooms:")
    lines.extend(f"  {room} ({len(names)}): {' '.join(names)}" for room, names in rooms.items())
    lines.append("Arrows back up (importer, floor -> imported, floor):")
    for arrow in wrong:
        importer, imported = arrow.importer, arrow.imported
        lines.append(
            f"  {short(importer)} {floor_of(importer)} -> {short(imported)} {floor_of(imported)}"
        )
    lines.append(
        f"rooms {len(rooms)}, floors {len(FLOORS)}, modules {len(everything)}, "
        f"arrows {len(all_arrows)}, arrows back up {len(wrong)}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(picture(build_graph()) + "\n")
