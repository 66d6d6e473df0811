"""The generated reference pages (scripts/gen_reference.py) are the code's current state: a config field or
a CLI option changed without ``make reference`` fails here, and every config dataclass has its section."""

import ast

import pytest

from scripts import gen_reference
from tests.helpers.paths import REPO


@pytest.mark.parametrize("page", sorted(gen_reference.PAGES))
def test_the_committed_reference_page_is_what_the_code_generates(page):
    committed = (REPO / page).read_text() if (REPO / page).is_file() else ""
    assert committed == gen_reference.PAGES[page]() + "\n", f"{page} is stale: run `{gen_reference.COMMAND}`"


def test_every_config_dataclass_of_the_package_has_a_section():
    found = set()
    for path in sorted((REPO / "moe_lit").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            is_dataclass = isinstance(node, ast.ClassDef) and any(
                ast.unparse(decorator).startswith(("dataclass", "dataclasses.dataclass"))
                for decorator in node.decorator_list
            )
            if is_dataclass and node.name.endswith("Config"):
                found.add(f"{module}.{node.name}")
    assert found == set(gen_reference.CONFIGS)


def test_a_field_row_carries_type_default_allowed_values_and_docstring():
    from moe_lit.config import MoEConfig

    rows = gen_reference._config_section(MoEConfig)
    row = next(line for line in rows if line.startswith("| `score_func` |"))
    assert row == (
        "| `score_func` | `ScoreFunc` | `'softmax'` | `softmax`, `sigmoid` | "
        "Router score function: softmax (MegaBlocks) \\| sigmoid (DeepSeek-V3). |"
    )
