"""The test tree's own rules: shared builders come from tests/helpers (never a conftest or test file); groups hold."""

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def _imported_modules(path: Path) -> list[str]:
    """Every module (and ``from M import name`` target) that ``path`` imports, relative ones included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names += [module, *(f"{module}.{alias.name}" for alias in node.names)]
    return names


def _is_test_module(name: str) -> bool:
    return any(part == "conftest" or part.startswith("test_") for part in name.split("."))


def test_no_test_imports_from_a_conftest_or_another_test_file():
    offenders = [
        f"{path.relative_to(TESTS)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in _imported_modules(path)
        if _is_test_module(name)
    ]
    assert offenders == [], "move the shared builders to tests/helpers/:\n" + "\n".join(offenders)


def test_the_rule_catches_both_import_forms(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("from tests.conftest import tiny\nfrom .test_other import helper\nfrom tests import test_x\n")
    assert [n for n in _imported_modules(bad) if _is_test_module(n)] == [
        "tests.conftest",
        "tests.conftest.tiny",
        "test_other",
        "test_other.helper",
        "tests.test_x",
    ]


@pytest.mark.xdist_group("test_tree")
def test_a_grouped_test_carries_its_group_under_loadgroup(request):
    # loadgroup keeps a group on one worker by this nodeid suffix (tests/conftest.py: keep_xdist_groups)
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("only --dist loadgroup (make test) groups tests")
    assert request.node.nodeid.endswith("@test_tree")
