"""The one config base: type-directed build, unknown keys, errors named under their section, dotted
overrides, the round trip to plain data, validated replace, and the study context (seq_len)."""

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import yaml

from moe_lit.config import ModelConfig
from moe_lit.configbase import ConfigBase, ConfigError, build, require_positive_int
from moe_lit.inference.sparsity import SparsityConfig
from moe_lit.lit.run_config import RunConfig


@dataclass
class Part(ConfigBase):
    size: int = 1
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        require_positive_int(self.size, "size")


@dataclass
class Whole(ConfigBase):
    section: ClassVar[str] = "whole"

    part: Part = field(default_factory=Part)
    spare: Part | None = None
    parts: list[Part] | None = None
    model: ModelConfig | None = None
    label: str = "x"


def test_sections_lists_and_optionals_are_built_by_their_field_types():
    whole = Whole.from_dict({"part": {"size": 2}, "spare": None, "parts": [{"size": 3}, {}], "model": {"d_model": 64}})
    assert whole.part == Part(size=2) and whole.spare is None
    assert whole.parts == [Part(size=3), Part()]
    assert isinstance(whole.model, ModelConfig) and whole.model.d_model == 64
    assert Whole.from_dict(None) == Whole() and Whole.from_dict(whole) is whole


@pytest.mark.parametrize(
    "data, message",
    [
        ({"colour": 1}, "whole: unknown key(s) ['colour'], allowed keys: ['part', 'spare', 'parts', 'model', 'label']"),
        ({"part": {"sise": 1}}, "part: unknown key(s) ['sise'], allowed keys: ['size', 'tags']"),
        ({"part": {"size": 0}}, "part.size: must be a positive integer, got 0"),
        ({"parts": [{}, {"size": -1}]}, "parts[1].size: must be a positive integer, got -1"),
        ({"parts": []}, "parts: must be a non-empty list of mappings, got []"),
        ({"part": 3}, "part: expected a mapping, got int"),
        # NOTE: ModelConfig names its own errors model.<field>; as a field it takes the field's name.
        ({"model": {"d_model": 0}}, "model.d_model: must be a positive integer, got 0"),
        ({"model": {"moe": {"top_k": 0}}}, "model.moe.top_k: must be a positive integer, got 0"),
    ],
)
def test_an_error_is_one_line_named_under_its_section(data, message):
    with pytest.raises(ConfigError) as info:
        Whole.from_dict(data)
    assert str(info.value) == message


def test_a_config_under_another_name_is_renamed_and_a_nameless_build_names_nothing():
    @dataclass
    class Spec:
        dense: ModelConfig

    with pytest.raises(ConfigError, match=r"^dense\.n_layers: must be a positive integer, got 0$"):
        build(Spec, {"dense": {"n_layers": 0}})
    with pytest.raises(ConfigError, match=r"^spec\.dense\.moe\.top_k: must be <= num_experts=2, got 3$"):
        build(Spec, {"dense": {"moe": {"num_experts": 2, "top_k": 3}}}, "spec")


def test_a_model_field_takes_the_study_seq_len_from_the_context():
    whole = Whole.from_dict({"model": {"seq_len": 512}}, seq_len=64)
    assert whole.model is not None and whole.model.seq_len == 64
    given = Whole.from_dict({"model": ModelConfig(seq_len=512)}, seq_len=32)
    assert given.model is not None and given.model.seq_len == 32
    assert Whole.from_dict({"model": {"seq_len": 512}}).model.seq_len == 512  # no context: its own


def test_dotted_overrides_change_one_field_and_a_new_budget_replaces_the_old():
    run = RunConfig(train={"max_tokens": 4096, "val_every": 2}, trainer={"gradient_clip_val": 1.0})
    changed = run.with_overrides({"train.seed": 7, "trainer.precision": "32-true", "optim.lr": 0.01})
    assert (changed.train.seed, changed.train.max_tokens, changed.train.val_every) == (7, 4096, 2)
    assert changed.trainer == {"gradient_clip_val": 1.0, "precision": "32-true"} and changed.optim.lr == 0.01
    longer = run.with_overrides({"train.max_steps": 10})
    assert (longer.train.max_steps, longer.train.max_tokens) == (10, None)
    assert run.train.seed == 0 and run.trainer == {"gradient_clip_val": 1.0}  # the source is untouched
    with pytest.raises(ConfigError, match=r"^train\.max_tokens: set exactly one of max_tokens and max_steps"):
        run.with_overrides({"train.max_steps": 10, "train.max_tokens": 64})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"train.sed": 1}, "train: unknown key(s) ['sed'], allowed keys: ['max_tokens'"),
        ({"colour.red": 1}, "run: unknown key(s) ['colour'], allowed keys: ['data', 'optim', 'train', 'trainer']"),
        ({"train.seed": "x"}, "train.seed: must be an integer, got 'x'"),
        ({"data.seq_len.deep": 1}, "data.seq_len: is not a section, cannot set ['deep']"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(changes, message):
    with pytest.raises(ConfigError) as info:
        RunConfig().with_overrides(changes)
    assert str(info.value).startswith(message)


def test_command_line_settings_are_checked_by_name_before_any_value():
    RunConfig.check_settings({"train": {"max_steps": "not checked yet"}, "trainer": {"anything": 1}})
    with pytest.raises(ConfigError) as info:
        RunConfig.check_settings({"colour": {"red": 1}})
    assert str(info.value) == (
        "settings: unknown section(s) ['colour'], allowed sections: ['data', 'optim', 'train', 'trainer']"
    )
    with pytest.raises(ConfigError, match=r"^optim: unknown key\(s\) \['learning_rate'\]"):
        RunConfig.check_settings({"optim": {"learning_rate": 1}})


@pytest.mark.parametrize(
    "config",
    [
        RunConfig(data={"languages": ["en"]}, optim={"betas": (0.8, 0.9)}, train={"max_steps": 3}),
        ModelConfig(moe={"num_experts": 4, "expert_size": [8, 8, 16, 16], "top_k": 2}),
        SparsityConfig(target=0.5, rule="gate_up"),
        Whole(parts=[Part(tags=("a", "b"))]),
    ],
)
def test_to_dict_is_plain_yaml_and_builds_an_equal_config(config):
    data = config.to_dict()
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # tuples became lists
    assert type(config).from_dict(data) == config
    assert type(config).from_yaml(config.to_yaml()) == config


def test_replace_is_validated_and_merges_a_mapping_into_its_section():
    dense = ModelConfig(d_model=64)
    moe = dense.replace(moe={"top_k": 1})
    assert moe.moe is not None and moe.moe.top_k == 1 and moe.moe.num_experts == 8 and moe.d_model == 64
    assert moe.replace(moe={"num_experts": 4}).moe.top_k == 1
    assert moe.replace(moe=None).moe is None
    with pytest.raises(ConfigError, match=r"^model\.d_model: must be a positive integer, got 0$"):
        dense.replace(d_model=0)


def test_from_yaml_names_a_bad_document_on_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^run: is not valid YAML \(line 1, column \d+: "):
        RunConfig.from_yaml("train: {max_steps: [1}")
    with pytest.raises(ConfigError, match=r"^run: no such file "):
        RunConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"^sparsity: must hold a mapping, got list"):
        SparsityConfig.from_yaml("[1, 2]")
