from pathlib import Path

import pytest

from moe_lit.evaluation.tasks import TEMPLATES_DIR
from moe_lit.resources import CONFIGS_DIR, packaged_config

REPO = Path(__file__).resolve().parents[1]
PRESET = "configs/model/tiny-moe.yaml"


def test_checkout_links_name_the_one_copy():
    assert CONFIGS_DIR.resolve() == REPO / "configs"
    assert TEMPLATES_DIR.resolve() == REPO / "eval" / "templates"


@pytest.mark.parametrize("arg", ["--tokens", "100", "model/tiny-moe.yaml", "configs/model/missing.yaml"])
def test_other_arguments_are_unchanged(arg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert packaged_config(arg) == arg


def test_absent_configs_path_names_the_packaged_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert packaged_config(PRESET) == str(CONFIGS_DIR / "model/tiny-moe.yaml")
    assert packaged_config(f"--config={PRESET}") == f"--config={CONFIGS_DIR / 'model/tiny-moe.yaml'}"


def test_a_configs_tree_in_the_working_directory_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / PRESET).parent.mkdir(parents=True)
    (tmp_path / PRESET).write_text("model: {}\n")
    assert packaged_config(PRESET) == PRESET
