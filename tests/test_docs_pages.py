"""Every page under docs/ is short and tells the current state: at most :data:`MAX_LINES` lines, and no
``git show`` of an earlier result (a result file's own metadata carries its provenance, issue 54)."""

import pytest

from tests.helpers.paths import REPO

MAX_LINES = 250
GENERATED = "docs/reference/"
"""Generated from the code (scripts/gen_reference.py, checked by tests/test_reference.py): one row per
config field or option, looked up rather than read through, so no length limit."""
PAGES = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "docs").rglob("*.md"))


@pytest.mark.parametrize("page", PAGES)
def test_a_page_quotes_no_git_show(page):
    quoting = [n for n, line in enumerate((REPO / page).read_text().splitlines(), 1) if "git show" in line]
    assert not quoting, f"{page}: `git show` on lines {quoting}; name the result file instead"


@pytest.mark.parametrize("page", [page for page in PAGES if not page.startswith(GENERATED)])
def test_a_page_has_at_most_250_lines(page):
    lines = len((REPO / page).read_text().splitlines())
    assert lines <= MAX_LINES, f"{page}: {lines} lines, at most {MAX_LINES}; split it or cut history"
