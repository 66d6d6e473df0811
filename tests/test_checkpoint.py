import errno
import os

import pytest
import torch

from moe_lit.checkpoint import export_model, load_model, read_lightning_checkpoint
from moe_lit.console_script import main
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from tests.helpers.checkpoints import CASES, bad_checkpoint, lightning_checkpoint
from tests.helpers.models import tiny


@pytest.mark.parametrize("cfg", [tiny(), tiny(dense=True, tie_embeddings=True), tiny(balancing="bias")])
def test_export_and_load_round_trip_bit_for_bit(tmp_path, cfg):
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    if cfg.is_moe and cfg.moe.balancing == "bias":
        model.blocks[0].ffn.router.expert_bias.fill_(0.25)
    out = export_model(model, tmp_path / "export")
    again = load_model(out)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.equal(model(idx).logits_BLV, again(idx).logits_BLV)
    assert again.config == cfg
    assert not list(tmp_path.glob(".export*"))  # no temporary directory left behind


def test_missing_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(MoeLitError, match="no such file"):
        load_model(tmp_path / "nope.ckpt")


# ---------------------------------------------------------------- reading never runs code; file errors


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def hostile(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "hostile.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"model": Payload(marker)}}, path)
    torch.load(path, weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    return path, marker


def _one_line_exit_2(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--checkpoint", "{ckpt}", "--tasks", "moe_lit_pairs"],
        ["analyze", "routing", "--checkpoint", "{ckpt}"],
        ["convert", "expand", "--checkpoint", "{ckpt}", "--factor", "2", "--out", "{out}"],
        ["convert", "upcycle", "--checkpoint", "{ckpt}", "--out", "{out}"],
        ["fit", "--config", "configs/experiments/tiny-moe.yaml", "--ckpt_path", "{ckpt}"],
        ["validate", "--config", "configs/experiments/tiny-moe.yaml", "--ckpt_path", "{ckpt}"],
    ],
)
def test_a_hostile_checkpoint_is_refused_by_every_command_and_its_code_never_runs(capsys, tmp_path, hostile, argv):
    path, marker = hostile
    argv = [a.format(ckpt=path, out=tmp_path / "out") for a in argv]
    err = _one_line_exit_2(capsys, argv)
    assert str(path) in err and "refused" in err and "posix.system" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_weights_only_false_is_refused_on_the_command_line(capsys, tmp_path):
    err = _one_line_exit_2(capsys, ["fit", "--config", "configs/experiments/tiny-moe.yaml", "--weights_only", "false"])
    assert "weights_only: false is refused" in err


def test_a_checkpoint_with_old_dataclass_hyper_parameters_still_loads(tmp_path):
    torch.manual_seed(0)
    model = Transformer(tiny())
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"model": model.config}}, tmp_path / "old.ckpt")
    assert load_model(tmp_path / "old.ckpt").config == model.config


@pytest.fixture
def files(tmp_path):
    """A valid .ckpt and export of the same tiny model, plus a dense model's export."""
    torch.manual_seed(0)
    model = Transformer(tiny())
    return {
        "ckpt": lightning_checkpoint(tmp_path / "run.ckpt", model),
        "export": export_model(model, tmp_path / "export"),
        "dense": export_model(Transformer(tiny(dense=True)), tmp_path / "dense"),
    }


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_files_are_one_line_naming_the_file(capsys, tmp_path, files, case):
    path, words = bad_checkpoint(case, tmp_path, files)
    argv = ["convert", "expand", "--checkpoint", str(path), "--factor", "2", "--out", str(tmp_path / "out")]
    err = _one_line_exit_2(capsys, argv)
    assert words in err and str(path) in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_dense_model_is_the_wrong_kind_for_expansion_and_routing(capsys, tmp_path, files):
    err = _one_line_exit_2(
        capsys,
        ["convert", "expand", "--checkpoint", str(files["dense"]), "--factor", "2", "--out", str(tmp_path / "o")],
    )
    assert "dense" in err
    err = _one_line_exit_2(capsys, ["analyze", "routing", "--checkpoint", str(files["dense"]), "--data", str(tmp_path)])
    assert "dense" in err or str(tmp_path) in err


def test_an_unreadable_checkpoint_is_one_line(monkeypatch, tmp_path, files):
    # NOTE: simulated: the tests may run as root, for whom chmod 000 does not deny reads.
    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(MoeLitError, match=f"checkpoint {files['ckpt']}: cannot read \\(Permission denied\\)"):
        read_lightning_checkpoint(files["ckpt"])


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EACCES])
def test_disk_full_or_permission_denied_while_writing_is_one_line_and_leaves_nothing(
    monkeypatch, capsys, tmp_path, files, error
):
    import safetensors.torch
    from safetensors import SafetensorError

    def refused(*args, **kwargs):  # what safetensors raises when the system refuses its write
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(error)} (os error {error})")

    monkeypatch.setattr(safetensors.torch, "save_file", refused)
    out = tmp_path / "out"
    out.mkdir()
    (out / "previous.txt").write_text("kept")
    err = _one_line_exit_2(
        capsys, ["convert", "expand", "--checkpoint", str(files["ckpt"]), "--factor", "2", "--out", str(out), "--force"]
    )
    assert f"{out}: cannot write ({os.strerror(error)})" in err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temporary left
    assert (out / "previous.txt").read_text() == "kept"  # the previous output is untouched


def test_resolve_device_auto_and_refusals():
    from moe_lit.checkpoint import resolve_device

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(MoeLitError, match="device: 'gpu0' is not a torch device; allowed: auto, cpu"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(MoeLitError, match="device: cuda:0 requested but CUDA is not available"):
            resolve_device("cuda:0")


def test_a_run_directory_given_as_a_model_points_to_its_last_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert main(["export", "--checkpoint", str(run), "--format", "mixtral", "--out", str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    last = run / "checkpoints" / "last.ckpt"
    assert line == f"moe-lit export: error: checkpoint {run}: a run directory; pass its newest checkpoint {last}"


def test_dropping_the_training_state_keeps_the_weights_bit_for_bit(tmp_path):
    from moe_lit.checkpoint import drop_training_state, has_training_state

    model = Transformer(tiny())
    path = lightning_checkpoint(tmp_path / "last.ckpt", model)
    checkpoint = read_lightning_checkpoint(path)
    adam = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
    torch.save({**checkpoint, "optimizer_states": [adam], "lr_schedulers": [{"last_epoch": 3}], "global_step": 3}, path)
    assert has_training_state(path) and drop_training_state(path)
    kept = read_lightning_checkpoint(path)
    assert set(kept) == {"state_dict", "hyper_parameters", "global_step"} and not has_training_state(path)
    assert kept["state_dict"].keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(kept["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())
    loaded = load_model(path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert not drop_training_state(path)  # nothing left to drop: the file is not rewritten
