"""The docs keep up with the code: every setting and every check id is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from django_idempotency import checks, conf, problems
from django_idempotency.conf import DEFAULTS

DOCS = Path(__file__).resolve().parent.parent / "docs"


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
