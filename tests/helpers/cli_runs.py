"""``moe-lit fit`` on tiny prepared data: the flags of a tiny MoE run and the call."""

from moe_lit.console_script import main
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
    # NOTE: the experiment's train.precision auto probes the machine; the tests keep the trainer
    # file's own precision, so that a run means the same on every CPU (tests/lit/test_precision.py
    # covers auto).
    "--train.precision",
    "null",
]


def fit(prepared, *extra) -> int:
    """``moe-lit fit`` of the tiny experiment on the ``prepared`` data dir (a fixture of the same name)."""
    return main(["fit", "--config", EXPERIMENT, "--data.data_dir", str(prepared), *TINY, *extra])
