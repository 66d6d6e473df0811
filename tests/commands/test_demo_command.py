"""``moe-lit demo``: each model's run is the run YAML with the settings over it, under the model's
optimizer; the models are the dense_vs_sparse study's best arm; the whole card on tiny data, resumed
after an interrupt without redoing what finished."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

import moe_lit.commands.demo as demo
import moe_lit.commands.demo_card as card
from moe_lit.accounting import count_config_params, matched_moe_config
from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.lit.optim import OptimConfig
from moe_lit.studies.study import load_study
from tests.helpers.fixtures import unreadable_by_others
from tests.helpers.models import tiny


class Trained(Exception):
    """Stands in for training: the first model's run is what the test reads."""


@pytest.fixture
def first_run(tmp_path, monkeypatch):
    """The RunConfig demo trains its first model with, for the given arguments (nothing trains)."""
    runs = []

    def train_model(name, path, model_cfg, run_cfg, args, callbacks):
        runs.append(run_cfg)
        raise Trained

    monkeypatch.setattr(demo, "prepare_default_data", lambda data_dir: tmp_path / "data")
    monkeypatch.setattr(demo, "train_model", train_model)

    def run(*argv):
        out = ["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--force"]
        with pytest.raises(Trained):
            main(["demo", *out, *argv])
        return runs[-1]

    return run


def test_the_shipped_run_is_the_study_run_at_half_its_tokens(first_run, tmp_path):
    study_run = load_study(demo.STUDY).header.run
    run = first_run()
    assert (run.data.seq_len, run.data.batch_size, run.data.val_batches) == (128, 16, 4)
    assert (run.steps, run.eval_every, run.train.seed) == (244, 49, 0)  # 500k tokens, 5 validations
    assert run.optim == study_run.optim == OptimConfig(lr=1e-3, warmup_steps=50, schedule="cosine")
    assert run.trainer == study_run.trainer == {"gradient_clip_val": 1.0}
    assert run.data.data_dir == str(tmp_path / "data")


def test_the_models_are_the_study_best_arm_active_matched():
    study = load_study(demo.STUDY)
    dense, _ = demo.load_module_config(demo.MODELS["dense"])
    moe, _ = demo.load_module_config(demo.MODELS["moe"])
    assert dense.replace(vocab_size=2048, seq_len=128) == study.spec.dense_model("M")
    assert 32 in study.spec.grid.num_experts and 2 in study.spec.grid.top_k
    assert moe == matched_moe_config(dense, 32, 2, "active", **study.spec.grid.moe, expert_output_bias=False)
    counts = {name: count_config_params(cfg.replace(vocab_size=2048)) for name, cfg in (("d", dense), ("m", moe))}
    assert abs(counts["m"].active - counts["d"].active) / counts["d"].active < 1e-3
    assert study.header.prepare_config().vocab_size == 2048
    grow = demo.upcycling(dense, moe, steps=244, seed=0)
    plan = grow.upcycling
    assert (grow.at_steps, plan.recipe, plan.num_experts, plan.top_k, plan.granularity) == ([122], "granular", 32, 2, 2)
    assert plan.moe["expert_output_bias"] is False


def test_settings_go_over_the_yaml_and_the_model_optimizer(first_run, tmp_path):
    (tmp_path / "run.yaml").write_text("data: {batch_size: 4}\noptim: {warmup_steps: 0}\ntrain: {max_steps: 5}\n")
    run = first_run("--config", str(tmp_path / "run.yaml"), "--train.max_tokens", "2048", "--optim.lr=1e-3")
    assert (run.data.batch_size, run.train.max_steps, run.train.max_tokens, run.steps) == (4, None, 2048, 2)
    assert run.optim == OptimConfig(lr=1e-3, warmup_steps=0, schedule="cosine")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train.max_step", "5"], "train: unknown key(s) ['max_step'], allowed keys: ['max_tokens'"),
        (["--data.seq_len", "0"], "data.seq_len: must be a positive integer, got 0"),
        (["--config", "nowhere.yaml"], "--config: no such file nowhere.yaml"),
        (["--seeds", "0"], "--seeds: must be >= 1, got 0"),
        (["--eval-limit", "0"], "--eval-limit: must be >= 1 (items per suite task), got 0"),
    ],
)
def test_bad_settings_are_one_line_exit_2(argv, message, tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def _tiny_models(root: Path) -> dict[str, Path]:
    """A tiny dense model and its active-matched E4 top-2 MoE as demo model YAMLs."""
    dense = tiny(dense=True)
    moe = matched_moe_config(dense, 4, 2, "active", expert_output_bias=False)
    paths = {}
    for name, cfg in (("dense", dense), ("moe", moe)):
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump({"model": cfg.to_dict(), "optim": {"lr": 1e-2, "warmup_steps": 1}}))
    return paths


@pytest.mark.slow
def test_the_card_runs_end_to_end_and_resumes_without_redoing_finished_steps(
    prepared, tmp_path, monkeypatch, umask_022
):
    import moe_lit.commands.analyze as analyze
    import moe_lit.commands.eval as eval_command
    import moe_lit.lit.run as lit_run

    monkeypatch.setattr(demo, "MODELS", _tiny_models(tmp_path))
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["demo", "--out", str(out), "--work-dir", str(work), "--force", "--data.data_dir", str(prepared)]
    argv += ["--data.seq_len=16", "--data.batch_size=4", "--data.val_batches=1", "--train.max_steps=4"]
    argv += ["--train.val_every=2", "--seeds=2", "--eval-limit=2"]
    real_analyze = analyze.run

    def interrupted(args):  # Ctrl-C while the upcycled MoE's routing is analysed
        if args.out.name == "upcycled":
            raise KeyboardInterrupt
        return real_analyze(args)

    monkeypatch.setattr(analyze, "run", interrupted)
    assert main(argv) == 130
    assert not out.exists() and (work / "analysis" / "moe" / "routing.json").is_file()

    def redone(*args, **kwargs):
        raise AssertionError("a finished step ran again")

    analysed = []
    monkeypatch.setattr(lit_run, "train_run", redone)
    monkeypatch.setattr(eval_command, "run", redone)
    monkeypatch.setattr(analyze, "run", lambda args: analysed.append(args.out.name) or real_analyze(args))
    assert main([*argv, "--resume"]) == 0
    assert analysed == ["upcycled"]

    text = (out / card.PAGE).read_text()
    for plot in (card.LOSS_PLOT, card.SCORES_PLOT, card.ROUTING_PLOT):
        assert f"]({plot})" in text and (out / plot).read_bytes()[:4] == b"\x89PNG"
    table = re.findall(r"^\| (dense|moe|upcycled) \| [\d,]+ \|", text, re.MULTILINE)
    assert table == ["dense", "moe", "upcycled"]
    doc = json.loads((out / card.RESULTS_JSON).read_text())
    assert set(doc["runs"]) == {"dense", "moe", "dense-seed1", "moe-seed1", "upcycled"}
    spread = doc["seed_spread"]
    assert spread["losses"]["moe"] == [doc["runs"][n]["val_loss"] for n in ("moe", "moe-seed1")]
    assert spread["difference"]["estimate"] == pytest.approx(
        sum(spread["losses"]["moe"]) / 2 - sum(spread["losses"]["dense"]) / 2
    )
    assert "## Seed spread" in text and "MoE - dense, paired by seed" in text
    assert {row["language"] for row in doc["suite"]["upcycled"]} == {"en", "de", "ru"}

    upcycled = load_model(doc["runs"]["upcycled"]["checkpoint"])
    assert upcycled.config.is_moe and upcycled.config.moe.num_experts == 4
    assert upcycled.config.moe.expert_output_bias is False
    assert doc["runs"]["upcycled"]["active_params"] == doc["runs"]["dense"]["active_params"] + 2 * 4 * 32

    best = min(card.MOES, key=lambda name: doc["runs"][name]["val_loss"])
    hf_dir = out / card.MODELS_DIR / f"hf-{best}"
    from moe_lit.convert.hf.core import load_hf_model

    ids_1L = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        ours = load_model(doc["runs"][best]["checkpoint"]).eval()(ids_1L).logits_BLV
        theirs = load_hf_model(hf_dir).eval()(ids_1L).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    assert doc["transformers"]["max_abs_logit_diff"] < 1e-4 and doc["transformers"]["generated"]
    assert (out / "analysis" / "upcycled" / "routing.json").is_file() and (
        out / "eval" / "dense" / "results.md"
    ).is_file()
    assert unreadable_by_others(out, work) == []  # a colleague can read every output (umask 022)


@pytest.mark.slow
def test_a_demo_interrupted_twice_in_training_and_resumed_equals_an_uninterrupted_demo(
    prepared, tmp_path, monkeypatch, capsys
):
    from moe_lit.callbacks.preemption import Interrupted
    from moe_lit.checkpoint import read_lightning_checkpoint
    from tests.lit.fakes import SignalAt

    monkeypatch.setattr(demo, "MODELS", _tiny_models(tmp_path))
    settings = ["--data.data_dir", str(prepared), "--data.seq_len=16", "--data.batch_size=4", "--data.val_batches=1"]
    settings += ["--train.max_steps=8", "--train.val_every=4", "--eval-limit=2"]

    def argv(name: str) -> list[str]:
        return ["demo", "--out", str(tmp_path / name), "--work-dir", str(tmp_path / f"{name}-work"), *settings]

    assert main([*argv("full"), "--force"]) == 0
    real_train = demo.train_model
    stops = [2, 5]  # Ctrl-C at the start of the MoE's steps 3 and 6

    def train_model(name, config, model_cfg, run_cfg, args, callbacks):
        extra = [SignalAt(stops.pop(0))] if name == "moe" and stops else []
        return real_train(name, config, model_cfg, run_cfg, args, [*callbacks, *extra])

    monkeypatch.setattr(demo, "train_model", train_model)
    last = tmp_path / "cut-work" / "moe" / "checkpoints" / "last.ckpt"
    for resume in ([], ["--resume"]):
        with pytest.raises(Interrupted) as interrupted:
            main([*argv("cut"), "--force", *resume])
        assert interrupted.value.code == 130
    assert f"demo: training moe (moe.yaml, seed 0) continuing from {last}" in capsys.readouterr().out
    assert read_lightning_checkpoint(last)["global_step"] == 6  # the newest, not the first interruption's
    assert main([*argv("cut"), "--force", "--resume"]) == 0
    assert f"continuing from {last}" in capsys.readouterr().out
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    full = read_lightning_checkpoint(tmp_path / "full-work" / "moe" / "checkpoints" / "last.ckpt")
    cut = read_lightning_checkpoint(last)
    assert cut["global_step"] == full["global_step"] == 8
    assert all(torch.equal(cut["state_dict"][k], v) for k, v in full["state_dict"].items())  # bit-exact
    runs = {name: json.loads((tmp_path / name / card.RESULTS_JSON).read_text())["runs"] for name in ("full", "cut")}
    assert {n: r["val_loss"] for n, r in runs["cut"].items()} == {n: r["val_loss"] for n, r in runs["full"].items()}


def test_each_model_runs_the_run_file_under_its_own_optimizer_and_keeps_its_trainer_settings():
    # benchmarks.bf16_accuracy trains the demo's runs through this too: a run without the file's clipping
    # would be another recipe
    run_doc = yaml.safe_load(demo.RUN.read_text())
    models = {name: demo.load_module_config(path) for name, path in demo.MODELS.items()}
    runs = demo.model_runs({**run_doc, "optim": {"warmup_steps": 7}}, models)
    for name, (_, optim) in models.items():
        assert runs[name].trainer == run_doc["trainer"] and runs[name].trainer["gradient_clip_val"] == 1.0
        assert runs[name].optim == OptimConfig(**{**optim, "warmup_steps": 7}), name
        assert runs[name].train.max_tokens == run_doc["train"]["max_tokens"]
