"""The ``moe-lit convert`` options are derived from the transforms' configs and signatures, and the
family lists of the help texts from the family registry."""

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest
import torch

from moe_lit.checkpoint import export_model, load_model
from moe_lit.commands import convert
from moe_lit.commands.options import add_options
from moe_lit.console_script import ArgumentParser, main
from moe_lit.convert.dense_to_moe import UpcyclingConfig
from moe_lit.convert.expand import ExpansionConfig, expand_experts
from moe_lit.model import Transformer
from tests.helpers.models import tiny


@dataclass(frozen=True)
class Made:
    """A config made up for the test."""

    size: int = 3
    """How many."""
    kind: Literal["a", "b"] = "a"
    """Which one: a | b."""
    sizes: list[int] | None = None
    """Per layer."""
    flag: bool = False
    """Switch it on."""
    on: bool = True
    """Switch it off."""
    mode: Literal["x", "y"] | None = "x"
    """x | y | null for none."""

    def __post_init__(self) -> None:
        if self.kind not in ("a", "b"):
            raise ValueError(f"kind: got {self.kind!r}")


def test_every_field_is_an_option_with_its_type_default_and_docstring(capsys):
    parser = ArgumentParser(prog="made")
    options = add_options(parser, Made)
    args = parser.parse_args(["--size", "5", "--sizes", "1,2", "--flag", "--no-on", "--mode", "null"])
    assert Made(**options.values(args)) == Made(size=5, kind="a", sizes=[1, 2], flag=True, on=False, mode=None)
    assert Made(**options.values(parser.parse_args([]))) == Made()
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "--size SIZE How many (default: 3)" in text and "--kind {a,b} Which one: a | b (default: a)" in text
    assert "--sizes INT,... Per layer" in text and "--flag Switch it on" in text
    assert "--on, --no-on Switch it off (default: True)" in text and "--mode {x,y,null} x | y | null" in text


def test_rename_required_defaults_and_one_of():
    parser = ArgumentParser(prog="made")
    options = add_options(parser, Made, ("size", "sizes"), rename={"size": "count"}, one_of=("size", "sizes"))
    assert options.values(parser.parse_args(["--count", "4"])) == {"size": 4, "sizes": None}
    for argv in ([], ["--count", "4", "--sizes", "1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    required = ArgumentParser(prog="made")
    add_options(required, Made, ("size",), required=("size",), defaults={"size": 9})
    with pytest.raises(SystemExit):
        required.parse_args([])


def test_a_field_without_docstring_or_help_is_refused():
    with pytest.raises(TypeError, match=r"partition_dense.lr has no docstring; pass its help"):
        from moe_lit.convert.recipes import partition_dense

        add_options(argparse.ArgumentParser(), partition_dense, ("lr",))


def _actions() -> dict[str, argparse.ArgumentParser]:
    parser = ArgumentParser(prog="moe-lit convert")
    convert.configure(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize(
    "action, config, skipped",
    [
        ("upcycle", UpcyclingConfig, {"moe"}),
        ("expand", ExpansionConfig, {"selection", "utility_metric", "max_copies"}),
    ],
)
def test_each_config_field_of_a_transform_is_an_option_of_its_action(action, config, skipped):
    parser = _actions()[action]
    dests = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(config):
        assert (field.name in dests) == (field.name not in skipped), field.name
    # the help is the field's docstring (first words)
    assert dests["seed"].help.startswith("Seed of the")


def test_a_bad_value_is_the_configs_one_line_error_naming_the_field(tmp_path, capsys):
    torch.manual_seed(0)
    export_model(Transformer(tiny(dense=True)), tmp_path / "dense")
    argv = ["convert", "upcycle", "--checkpoint", str(tmp_path / "dense"), "--out", str(tmp_path / "x")]
    assert main([*argv, "--recipe", "clone"]) == 2
    err = capsys.readouterr().err
    assert err == "moe-lit convert upcycle: error: recipe: got 'clone', allowed values: copy, granular, drop\n"
    assert not (tmp_path / "x").exists()


def test_expand_with_the_derived_options_equals_the_transform(tmp_path):
    torch.manual_seed(0)
    source = Transformer(tiny(balancing="bias")).eval()
    export_model(source, tmp_path / "moe")
    extra = ["--factor", "2", "--router-noise", "0.1", "--drop-fraction", "0.25", "--seed", "3"]
    assert main(["convert", "expand", "--checkpoint", str(tmp_path / "moe"), "--out", str(tmp_path / "e"), *extra]) == 0
    expected = expand_experts(source, factor=2, router_noise=0.1, drop_fraction=0.25, seed=3)
    ours = load_model(tmp_path / "e").state_dict()
    assert all(torch.equal(value, ours[name]) for name, value in expected.state_dict().items())


def test_the_help_lists_every_registered_family(capsys):
    from moe_lit.convert.hf import FAMILIES

    for words in (["export"], ["convert", "import-hf"]):
        with pytest.raises(SystemExit):
            main([*words, "--help"])
    export_help, import_help = capsys.readouterr().out.split("example: moe-lit convert import-hf")
    import_help = " ".join(import_help.split())
    assert "{" + ",".join(FAMILIES.names()) + "}" in export_help
    assert f"directory of a causal LM ({', '.join(FAMILIES.names())})" in import_help
    with pytest.raises(ValueError, match="HF family name 'llama' of Family is taken by Family"):
        FAMILIES.register("llama", FAMILIES["llama"])


def test_expand_balancing_null_keeps_the_sources(tmp_path):
    torch.manual_seed(0)
    export_model(Transformer(tiny(balancing="aux_loss")), tmp_path / "moe")
    argv = ["convert", "expand", "--checkpoint", str(tmp_path / "moe"), "--factor", "2", "--noise", "0"]
    assert main([*argv, "--balancing", "null", "--out", str(tmp_path / "kept")]) == 0
    assert main([*argv, "--out", str(tmp_path / "bias")]) == 0
    assert load_model(tmp_path / "kept").config.moe.balancing == "aux_loss"
    assert load_model(tmp_path / "bias").config.moe.balancing == "bias"
