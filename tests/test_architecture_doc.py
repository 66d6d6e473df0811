"""docs/architecture.md states the layers contract of pyproject.toml (which `make lint` checks) row by row."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, as import-linter itself

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def _contract() -> dict:
    (contract,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return contract


def _doc_layers(text: str) -> list[list[str]]:
    """The package cell of every table row, as the contract's module names
    (``moe_lit/console_script.py`` -> ``console_script``)."""
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| layer ")]
    cells = [re.split(r"(?<!\\)\|", row)[2] for row in rows]
    return [[Path(path.rstrip("/")).stem for path in re.findall(r"`([^`]+)`", cell)] for cell in cells]


def _doc_ignored(text: str) -> set[str]:
    """The upward imports the doc's bullet list names: ``* `a` -> `b`, `c`: why`` -> a -> b, a -> c."""
    pairs = set()
    for importer, imported in re.findall(r"^\* `([\w.]+)` -> (.+?):", text, re.MULTILINE):
        pairs |= {f"moe_lit.{importer} -> moe_lit.{name}" for name in re.findall(r"`([\w.]+)`", imported)}
    return pairs


def test_the_doc_table_lists_the_contract_layers_top_down():
    layers = [[name.strip() for name in layer.split("|")] for layer in _contract()["layers"]]
    assert _doc_layers(DOC.read_text()) == layers


def test_the_doc_names_every_ignored_upward_import():
    assert _doc_ignored(DOC.read_text()) == set(_contract().get("ignore_imports", []))


def test_the_parsers_read_rows_and_bullets():
    text = "| layer | package | what |\n| a | `moe_lit/x.py` \\| `moe_lit/y/` | z |\n* `x` -> `y.p`, `y.q`: why\n"
    assert _doc_layers(text) == [["x", "y"]]
    assert _doc_ignored(text) == {"moe_lit.x -> moe_lit.y.p", "moe_lit.x -> moe_lit.y.q"}
