"""prepare -> fit a few steps -> checkpoint -> resume (same losses) -> validate through the CLI."""

import dataclasses
import math

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.run import read_metrics, train_run
from moe_lit.lit.run_config import DataConfig, RunConfig, TrainConfig
from tests.helpers.models import tiny
from tests.helpers.paths import EXPERIMENT

SEQ_LEN, BATCH, STEPS, KILLED_AT = 16, 4, 8, 3


def _run_config(prepared) -> RunConfig:
    return RunConfig(
        data=DataConfig(data_dir=str(prepared), seq_len=SEQ_LEN, batch_size=BATCH, val_batches=2),
        optim=OptimConfig(lr=1e-2, warmup_steps=2),
        train=TrainConfig(max_tokens=STEPS * SEQ_LEN * BATCH, val_every=4, seed=0),
        trainer={"log_every_n_steps": 1, "enable_progress_bar": False},
    )


def _run(prepared, out_dir, **kwargs):
    return train_run(tiny(), _run_config(prepared), out_dir, **kwargs)


def _losses(result) -> dict[int, float]:
    return {int(row["step"]): row["train/loss"] for row in read_metrics(result.metrics_csv) if "train/loss" in row}


@pytest.mark.slow
def test_resumed_run_repeats_the_uninterrupted_losses_then_validates_via_cli(prepared, tmp_path, capsys):
    every = ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=KILLED_AT, save_top_k=-1)
    full = _run(prepared, tmp_path / "full", callbacks=[every])
    assert (full.steps, full.tokens) == (STEPS, STEPS * SEQ_LEN * BATCH)
    assert set(full.val_loss_per_language) == {"de", "en", "ru"}
    assert math.isfinite(full.val_loss) and full.tokens_per_s > 0 and full.load_imbalance >= 1.0

    # the "killed" run: only its checkpoint at step 3 (mid-epoch) survives; resume it to the end
    resumed = _run(prepared, tmp_path / "resumed", resume_from=tmp_path / "every" / f"epoch=0-step={KILLED_AT}.ckpt")
    full_losses, resumed_losses = _losses(full), _losses(resumed)
    assert sorted(full_losses) == list(range(STEPS))
    assert sorted(resumed_losses) == list(range(KILLED_AT, STEPS))
    assert resumed_losses == {step: full_losses[step] for step in range(KILLED_AT, STEPS)}  # bit-exact
    assert resumed.val_loss == full.val_loss
    assert load_model(full.checkpoint).config == tiny().replace(vocab_size=300, seq_len=SEQ_LEN)

    # the CLI on the final weights: experiment config, real datamodule; with --ckpt_path the model
    # section comes from the checkpoint's hyper-parameters (plain dicts)
    code = main(
        [
            "validate",
            "--config",
            EXPERIMENT,
            "--data.data_dir",
            str(prepared),
            f"--data.seq_len={SEQ_LEN}",
            f"--data.batch_size={BATCH}",
            "--data.val_batches=2",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'cli'}",
            "--trainer.enable_progress_bar=false",
            f"--ckpt_path={full.checkpoint}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    (metrics,) = list((tmp_path / "cli").rglob("metrics.csv"))
    cli_rows = [row for row in read_metrics(metrics) if "val/loss" in row]
    assert cli_rows[-1]["val/loss"] == pytest.approx(full.val_loss, rel=1e-6)

    # the demo's report of that run: table, JSON, plot and the exported model, all in one directory
    from moe_lit.commands.demo_card import MODELS_DIR, PAGE, write_results
    from moe_lit.data.layout import tokenizer_file

    timed = {
        "eager_tokens_per_s": 1000.4,
        "compiled_tokens_per_s": 1100.6,
        "compiled_speedup": 1.1004,
        "compile_s": 9.04,
    }
    write_results({"moe": full}, {"tokens": full.tokens}, tokenizer_file(prepared), tmp_path / "demo", {"moe": timed})
    table = (tmp_path / "demo" / PAGE).read_text()
    assert (
        "| model | total params | active params | tokens | val loss | imbalance | tokens/s "
        "| step tok/s eager | step tok/s compiled | compiled speedup | compile s |" in table
    )
    assert f"| moe | 40,160 | 34,016 | 512 | {full.val_loss:.4f} |" in table
    assert "| 1000 | 1101 | 1.1 | 9 |" in table
    assert (tmp_path / "demo" / "val_loss.png").read_bytes()[:4] == b"\x89PNG"
    exported = load_model(tmp_path / "demo" / MODELS_DIR / "moe")
    assert exported.config == load_model(full.checkpoint).config
    assert (tmp_path / "demo" / MODELS_DIR / "moe" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_one_experiment_yaml_gives_the_same_run_through_fit_and_train_run(prepared, tmp_path, capsys):
    """The data / model.optim / train / trainer sections of one YAML feed both entry points."""
    import yaml

    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(
        yaml.safe_dump(
            {
                "model": {
                    "model": tiny().to_dict() | {"vocab_size": 300, "seq_len": SEQ_LEN},
                    "optim": {"lr": 1e-2, "warmup_steps": 2},
                },
                "data": {
                    "data_dir": str(prepared),
                    "seq_len": SEQ_LEN,
                    "batch_size": BATCH,
                    "val_batches": 2,
                    "seed": 0,
                },
                "train": {"max_tokens": STEPS * SEQ_LEN * BATCH, "val_every": 4, "seed": 0},  # RunConfig's names
                "trainer": {
                    "num_sanity_val_steps": 0,
                    "log_every_n_steps": 1,
                    "enable_progress_bar": False,
                    "accelerator": "cpu",
                    "devices": 1,
                },
            }
        )
    )
    model_cfg, run_cfg = RunConfig.from_experiment(experiment)
    assert (run_cfg.steps, run_cfg.train.seed, run_cfg.optim.lr, run_cfg.data.val_batches) == (STEPS, 0, 1e-2, 2)
    direct = train_run(model_cfg, run_cfg, tmp_path / "direct")
    code = main(["fit", "--config", str(experiment), f"--trainer.logger.init_args.save_dir={tmp_path / 'cli'}"])
    assert code == 0, capsys.readouterr().err
    (metrics,) = list((tmp_path / "cli").rglob("metrics.csv"))
    cli_losses = {int(r["step"]): r["train/loss"] for r in read_metrics(metrics) if "train/loss" in r}
    assert cli_losses == pytest.approx(_losses(direct), rel=1e-6)


def test_zero_step_run_validates_the_initial_weights_unchanged(prepared, tmp_path):
    first = _run(prepared, tmp_path / "trained")
    run = _run_config(prepared).replace(train={"max_steps": 0})
    result = train_run(tiny(), run, tmp_path / "eval", init_from=first.checkpoint)
    assert result.steps == 0 and result.tokens == 0
    assert result.val_loss == pytest.approx(first.val_loss, abs=1e-6)  # the same weights, the same val batches
    assert result.val_loss_per_language.keys() == first.val_loss_per_language.keys()
    trained, evaluated = load_model(first.checkpoint).state_dict(), load_model(result.checkpoint).state_dict()
    assert all((trained[k] == evaluated[k]).all() for k in trained)
    with pytest.raises(Exception, match="0-step run only validates"):
        train_run(tiny(), run, tmp_path / "resumed", resume_from=first.checkpoint)


def test_the_record_holds_the_dropped_fraction_of_a_capacity_limited_run(prepared, tmp_path):
    # capacity factor 0.5 keeps at most half of each expert's fair share: some assignments drop
    run = _run_config(prepared)
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, max_tokens=2 * SEQ_LEN * BATCH, val_every=2))
    limited, dropless, dense = (
        train_run(model, run, tmp_path / name)
        for name, model in [("limited", tiny(capacity_factor=0.5)), ("dropless", tiny()), ("dense", tiny(dense=True))]
    )
    assert 0.0 < limited.dropped_fraction < 1.0
    assert dropless.dropped_fraction == dense.dropped_fraction == 0.0


@pytest.mark.parametrize("val_every", [3, 4], ids=["last-step-not-validated", "last-step-validated"])
def test_a_run_resumed_from_its_final_checkpoint_keeps_its_metrics_and_result(prepared, tmp_path, val_every):
    """A run killed after its final checkpoint continues into its own directory: the same result,
    its metrics kept, whether or not its last step was a ``val_every`` step (the restored curve
    then ends there, but this process has validated nothing)."""
    run = dataclasses.replace(_run_config(prepared), train=TrainConfig(max_steps=STEPS, val_every=val_every, seed=0))
    first = train_run(tiny(), run, tmp_path / "run")
    first_losses = _logged_losses(first)
    again = train_run(tiny(), run, tmp_path / "run", resume_from=first.checkpoint)
    assert again.val_loss == first.val_loss
    assert _logged_losses(again) == first_losses  # every step's train and validation losses, once


def _logged_losses(result) -> list[tuple[int, str, float]]:
    rows = read_metrics(result.metrics_csv)
    return sorted((int(row["step"]), key, value) for row in rows for key, value in row.items() if "loss" in key)
