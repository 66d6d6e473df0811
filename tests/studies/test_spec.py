"""The kinds' spec parser: the base's builder with the study's checks (unknown and required keys,
the run's seq_len in every model config, errors named under their section)."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from moe_lit.config import ModelConfig
from moe_lit.configbase import ConfigError
from moe_lit.lit.run_config import RunConfig
from moe_lit.studies import spec


@dataclass
class Spec:
    dense: ModelConfig
    recovery: spec.FineTune = field(default_factory=spec.FineTune)
    students: list[ModelConfig] | None = None


HEADER = SimpleNamespace(run=RunConfig(data={"seq_len": 48}))
parse = spec.parser(Spec, required=("dense",))


def test_sections_are_built_and_every_model_takes_the_run_seq_len():
    parsed = parse({"dense": {"d_model": 64}, "recovery": {"steps": 8, "warmup": 2}, "students": [{}, {}]}, HEADER)
    assert parsed.dense == ModelConfig(d_model=64, seq_len=48)
    assert parsed.recovery == spec.FineTune(steps=8, warmup=2)
    assert parsed.students == [ModelConfig(seq_len=48)] * 2


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "dense: is required"),
        ({"dense": {}, "colour": 1}, "study: unknown key(s) ['colour'], allowed keys (besides the header's): ['dense'"),
        ({"dense": {}, "recovery": {"steps": 4, "warmup": 4}}, "recovery.warmup: must be an integer in [0, steps)"),
        ({"dense": {"n_layers": 0}}, "dense.n_layers: must be a positive integer, got 0"),
        ({"dense": {}, "students": [{}, {"d_model": 3}]}, "students[1].n_heads: d_model=3 must be divisible"),
    ],
)
def test_errors_are_one_line_named_under_their_section(fields, message):
    with pytest.raises(ConfigError) as info:
        parse(fields, HEADER)
    assert str(info.value).startswith(message)


def test_build_is_the_base_builder_named_under_its_section():
    assert spec.build(spec.FineTune, None, "recovery") == spec.FineTune()
    with pytest.raises(ConfigError, match=r"^recovery\.lr: must be a number > 0, got 0$"):
        spec.build(spec.FineTune, {"lr": 0}, "recovery")
