"""prepare -> fit a few steps -> checkpoint -> resume (same losses) -> validate through the CLI."""

import math

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from moe_lit.checkpoint import load_model
from moe_lit.cli import main
from moe_lit.data.prepare import PrepareConfig, prepare
from moe_lit.lit.optim import OptimConfig
from moe_lit.lit.runner import read_metrics, train_run
from tests.conftest import tiny
from tests.data.conftest import write_corpus
from tests.lit.test_cli import EXPERIMENT

SEQ_LEN, BATCH, STEPS, KILLED_AT = 16, 4, 8, 3


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    corpus = write_corpus(root / "corpus", files=2, paragraphs=40)
    out = root / "data"
    prepare(PrepareConfig(source=str(corpus), out=out, vocab_size=300, val_fraction=0.1, test_fraction=0.1,
                          progress=False))
    return out


def _run(prepared, out_dir, **kwargs):
    return train_run(
        tiny(), prepared, out_dir, max_tokens=STEPS * SEQ_LEN * BATCH, seq_len=SEQ_LEN, batch_size=BATCH,
        optim=OptimConfig(lr=1e-2, warmup_steps=2), seed=0, val_batches=2,
        trainer_overrides={"log_every_n_steps": 1, "enable_progress_bar": False}, eval_every=4, **kwargs,
    )


def _losses(result) -> dict[int, float]:
    return {int(row["step"]): row["train/loss"] for row in read_metrics(result.metrics_csv) if "train/loss" in row}


@pytest.mark.slow
def test_resumed_run_repeats_the_uninterrupted_losses_then_validates_via_cli(prepared, tmp_path, capsys):
    every = ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=KILLED_AT, save_top_k=-1)
    full = _run(prepared, tmp_path / "full", extra_callbacks=[every])
    assert (full.steps, full.tokens) == (STEPS, STEPS * SEQ_LEN * BATCH)
    assert set(full.val_loss_per_language) == {"de", "en", "ru"}
    assert math.isfinite(full.val_loss) and full.tokens_per_s > 0 and full.load_imbalance >= 1.0

    # the "killed" run: only its checkpoint at step 3 (mid-epoch) survives; resume it to the end
    resumed = _run(prepared, tmp_path / "resumed", ckpt_path=tmp_path / "every" / f"epoch=0-step={KILLED_AT}.ckpt")
    full_losses, resumed_losses = _losses(full), _losses(resumed)
    assert sorted(full_losses) == list(range(STEPS))
    assert sorted(resumed_losses) == list(range(KILLED_AT, STEPS))
    assert resumed_losses == {step: full_losses[step] for step in range(KILLED_AT, STEPS)}  # bit-exact
    assert resumed.val_loss == full.val_loss
    assert load_model(full.checkpoint).config == tiny().replace(vocab_size=300, seq_len=SEQ_LEN)

    # the CLI on the final weights: experiment config, real datamodule; with --ckpt_path the model
    # section comes from the checkpoint's hyper-parameters (plain dicts)
    code = main(["validate", "--config", EXPERIMENT, "--data.data_dir", str(prepared),
                 f"--data.seq_len={SEQ_LEN}", f"--data.batch_size={BATCH}", "--data.val_batches=2",
                 f"--trainer.logger.init_args.save_dir={tmp_path / 'cli'}", "--trainer.enable_progress_bar=false",
                 f"--ckpt_path={full.checkpoint}"])
    assert code == 0, capsys.readouterr().err
    (metrics,) = list((tmp_path / "cli").rglob("metrics.csv"))
    cli_rows = [row for row in read_metrics(metrics) if "val/loss" in row]
    assert cli_rows[-1]["val/loss"] == pytest.approx(full.val_loss, rel=1e-6)

    # the demo's report of that run: table, JSON, plot and the exported model, all in one directory
    from moe_lit.commands.demo import MODELS_DIR, write_results
    from moe_lit.data.layout import tokenizer_file

    write_results({"moe": full}, {"tokens": full.tokens}, tokenizer_file(prepared), tmp_path / "demo")
    table = (tmp_path / "demo" / "results.md").read_text()
    assert "| model | total params | active params | tokens | val loss | de | en | ru | tokens/s |" in table
    assert f"| moe | 40,160 | 34,016 | 512 | {full.val_loss:.4g} |" in table
    assert (tmp_path / "demo" / "val_loss.png").read_bytes()[:4] == b"\x89PNG"
    exported = load_model(tmp_path / "demo" / MODELS_DIR / "moe")
    assert exported.config == load_model(full.checkpoint).config
    assert (tmp_path / "demo" / MODELS_DIR / "moe" / "tokenizer.json").is_file()
