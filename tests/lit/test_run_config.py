import pytest

from moe_lit.config import ConfigError
from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig


def test_yaml_round_trip_and_derived_budget(tmp_path):
    run = RunConfig(
        data={"seq_len": 32, "batch_size": 4, "languages": ["en", "de"]},
        optim={"lr": 3e-3},
        train={"max_tokens": 1000, "seed": 3},
        trainer={"precision": "32-true"},
    )
    assert (run.steps, run.tokens, run.eval_every) == (7, 7 * 128, 1)  # 1000 // 128 steps, 8 validations at most
    path = tmp_path / "run.yaml"
    path.write_text(run.to_yaml())
    assert RunConfig.from_yaml(path) == run


def test_replace_changes_fields_and_a_new_budget_replaces_the_old():
    run = RunConfig(train={"max_tokens": 4096, "val_every": 2})
    longer = run.replace(train={"max_steps": 10}, data={"batch_size": 2})
    assert (longer.train.max_steps, longer.train.max_tokens, longer.train.val_every) == (10, None, 2)
    assert longer.data.batch_size == 2 and longer.data.seq_len == run.data.seq_len
    assert run.train.max_tokens == 4096  # the source is untouched


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"data": {"seq_len": 0}}, "data.seq_len: must be a positive integer, got 0"),
        ({"data": {"languages": []}}, "data.languages: must be a non-empty list"),
        ({"data": {"colour": 1}}, "data: unknown key(s) ['colour']"),
        (
            {"train": {"max_tokens": 10, "max_steps": 2}},
            "train.max_tokens: set exactly one of max_tokens and max_steps",
        ),
        ({"train": {"max_steps": 2, "val_every": 0}}, "train.val_every: must be a positive integer"),
        ({"train": {"max_steps": -1}}, "train.max_steps: must be an integer >= 0 (0 = validate only)"),
        ({"train": {"max_tokens": 10}}, "train.max_tokens: 10 is less than one batch"),
        ({"optim": {"lr": -1}}, "optim.lr: must be > 0"),
        ({"trainer": {"callbacks": []}}, "trainer.callbacks: pass callbacks to train_run"),
        ({"trainer": 3}, "trainer: must be a mapping"),
    ],
)
def test_errors_name_the_field(kwargs, message):
    with pytest.raises(ConfigError) as info:
        RunConfig(**kwargs)
    assert message in str(info.value)


def test_sections_accept_their_dataclasses_and_unknown_top_level_keys_are_named():
    run = RunConfig(data=DataConfig(seq_len=8), train=TrainConfig(max_steps=1))
    assert run.data.seq_len == 8
    with pytest.raises(ConfigError, match=r"run: unknown key\(s\) \['model'\]"):
        RunConfig.from_dict({"model": {}})


def test_experiment_yaml_sections_with_files_relative_to_the_experiment(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.yaml").write_text("model: {d_model: 32, n_heads: 4}\noptim: {lr: 0.01}\n")
    experiment = tmp_path / "exp.yaml"
    experiment.write_text(
        "seed_everything: 5\nmodel: model/m.yaml\ndata: {seq_len: 16, batch_size: 2, seed: 9}\n"
        "trainer: {max_steps: 4, gradient_clip_val: 1.0}\n"
    )
    model, run = RunConfig.from_experiment(experiment)
    assert model.d_model == 32 and run.optim.lr == 0.01
    assert (run.train.seed, run.steps, run.trainer) == (5, 4, {"gradient_clip_val": 1.0})
