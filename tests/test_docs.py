"""The docs keep up with the code: every setting and every check id is documented, and every
page is in the docs site's navigation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from django_idempotency import checks, conf, problems
from django_idempotency.conf import DEFAULTS

DOCS = Path(__file__).resolve().parent.parent / "docs"
MKDOCS = DOCS.parent / "mkdocs.yml"


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_every_setting_is_documented(name):
    assert re.search(rf"^### {name}$", (DOCS / "settings.md").read_text(), re.MULTILINE)


SOURCES = "".join(Path(module.__file__).read_text() for module in (checks, conf))


@pytest.mark.parametrize(
    "check_id", sorted(set(re.findall(r"django_idempotency\.[EW]\d{3}", SOURCES)))
)
def test_every_check_is_documented(check_id):
    assert check_id in (DOCS / "checks.md").read_text()


@pytest.mark.parametrize("problem", problems.ALL, ids=lambda problem: problem.code)
def test_every_error_code_is_documented(problem):
    assert problem.code in (DOCS / "errors.md").read_text()


def nav_pages() -> set[str]:
    """The pages under `nav:` in mkdocs.yml, read without a YAML parser (`- Title: page.md`)."""
    nav = re.search(r"^nav:\n((?:[ \t]+.*\n|\n)*)", MKDOCS.read_text(), re.MULTILINE)
    assert nav, "mkdocs.yml has no nav"
    return set(re.findall(r"^\s*-\s+(?:.*:\s+)?(\S+\.md)\s*$", nav.group(1), re.MULTILINE))


@pytest.mark.parametrize(
    "page", sorted(path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md"))
)
def test_every_page_is_in_the_site_navigation(page):
    assert page in nav_pages()


def test_the_site_navigation_lists_only_existing_pages():
    assert {page for page in nav_pages() if not (DOCS / page).is_file()} == set()
