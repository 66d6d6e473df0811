"""``moe-lit fit`` runs end to end on tiny prepared data: where its files go, and a diverging run."""

import pytest

from moe_lit.checkpoint import load_model
from moe_lit.cli import main
from moe_lit.data.prepare import PrepareConfig, prepare
from tests.helpers.corpus import write_corpus
from tests.helpers.paths import EXPERIMENT

TINY = [
    "--model.model.d_model",
    "32",
    "--model.model.n_layers",
    "2",
    "--model.model.d_ff",
    "64",
    "--model.model.moe.num_experts",
    "4",
    "--model.model.moe.expert_size",
    "16",
    "--data.seq_len",
    "16",
    "--data.batch_size",
    "4",
    "--data.val_batches",
    "1",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.log_every_n_steps",
    "1",
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_runs")
    corpus = write_corpus(root / "corpus", files=2, paragraphs=40)
    prepare(
        PrepareConfig(
            source=str(corpus), out=root / "data", vocab_size=300, val_fraction=0.1, test_fraction=0.1, progress=False
        )
    )
    return root / "data"


def _fit(prepared, *extra):
    return main(["fit", "--config", EXPERIMENT, "--data.data_dir", str(prepared), *TINY, *extra])


@pytest.mark.slow
def test_default_root_dir_decides_where_logs_and_checkpoints_go(prepared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "elsewhere"
    assert _fit(prepared, "--trainer.max_steps", "2", "--trainer.default_root_dir", str(root)) == 0
    run = root / "lightning_logs" / "version_0"
    assert (run / "metrics.csv").is_file() and (run / "config.yaml").is_file()
    assert load_model(run / "checkpoints" / "last.ckpt").config.d_model == 32
    assert not (tmp_path / "runs").exists()
    # without it, the default stays runs/
    assert _fit(prepared, "--trainer.max_steps", "1") == 0
    assert (tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_a_diverging_run_stops_with_one_line_exit_2_and_keeps_the_last_finite_checkpoint(
    prepared, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = _fit(
        prepared, "--model.optim.lr", "1e6", "--trainer.max_steps", "30", "--checkpoint.every_n_train_steps", "1"
    )
    err = [line for line in capsys.readouterr().err.splitlines() if "moe-lit fit: error:" in line]
    assert code == 2 and len(err) == 1 and "training diverged at step" in err[0], err
    last = tmp_path / "runs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert all(v.isfinite().all() for v in load_model(last).state_dict().values())
