"""Every name the docs show users, by import or by dotted path, resolves.

The package's layout may change; what a user's code, settings and logging configuration name
must keep working. The names are read from the docs themselves, so a page that shows a new one
is guarded too.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Not the changelog: it tells what each name was when it changed.
PAGES = [page for page in PAGES if page.name != "changelog.md"]

FROM_IMPORT = re.compile(
    r"^\s*from (django_idempotency(?:\.\w+)*) import \(?([\w, \n]+?)\)?\s*$", re.MULTILINE
)
# A dotted name in code or in a setting: `django_idempotency.x.Y` or "django_idempotency.x.y".
DOTTED = re.compile(r"[`\"'](django_idempotency(?:\.\w+)+)(?:\(\))?[`\"']")
# Check ids (E001) and the package's Celery task names are not import paths.
CHECK_ID = re.compile(r"django_idempotency\.[EW]\d{3}")
TASK_NAMES = set(
    re.findall(
        r'@task\("(django_idempotency\.\w+)"', (ROOT / "django_idempotency/tasks.py").read_text()
    )
)


def _imports() -> set[tuple[str, str]]:
    found = set()
    for page in PAGES:
        for module, names in FROM_IMPORT.findall(page.read_text()):
            for name in names.replace("\n", " ").split(","):
                if name := name.strip().split(" as ")[0]:
                    found.add((module, name))
    return found


def _dotted() -> set[str]:
    found = set()
    for page in PAGES:
        for path in DOTTED.findall(page.read_text()):
            if not CHECK_ID.fullmatch(path) and path not in TASK_NAMES:
                found.add(path)
    return found


def _resolve(path: str) -> object:
    """The module, or the attribute of the longest module prefix, that ``path`` names."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ModuleNotFoundError(path)


def test_the_docs_show_names_to_check():
    # The patterns still find what the pages show.
    assert ("django_idempotency.drf", "IdempotentMixin") in _imports()
    assert "django_idempotency.correlation.CorrelationIdMiddleware" in _dotted()
    assert "django_idempotency.backoff" in _dotted()
    assert "django_idempotency.purge_expired_keys" in TASK_NAMES


@pytest.mark.parametrize(("module", "name"), sorted(_imports()))
def test_every_name_the_docs_import_resolves(module, name):
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("path", sorted(_dotted()))
def test_every_dotted_name_the_docs_show_resolves(path):
    assert _resolve(path) is not None
