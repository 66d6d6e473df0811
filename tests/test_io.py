"""The one overwrite rule (check_output), atomic outputs, and their modes under the umask."""

import os

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory, atomic_file, atomic_write_text, check_output
from tests.helpers.fixtures import unreadable_by_others


def test_check_output_refuses_inputs_always_and_non_empty_outputs_without_force(tmp_path):
    source = tmp_path / "run" / "last.ckpt"
    source.parent.mkdir()
    source.write_bytes(b"x")
    for out in (source, tmp_path / "run", tmp_path):  # the input itself, or a folder holding it
        with pytest.raises(MoeLitError, match="--out: .* is or contains the input --checkpoint"):
            check_output(out, {"--checkpoint": source}, force=True)
    with pytest.raises(MoeLitError, match="lies inside the input --data"):
        check_output(tmp_path / "run" / "sub", {"--data": tmp_path / "run"}, force=True)
    with pytest.raises(MoeLitError, match="exists and is not empty; pass --force"):
        check_output(tmp_path / "run", {"--checkpoint": None})
    (tmp_path / "empty").mkdir()
    assert check_output(tmp_path / "empty") == tmp_path / "empty"
    assert check_output(tmp_path / "absent", {"--checkpoint": source}) == tmp_path / "absent"
    assert check_output(tmp_path / "run", force=True) == tmp_path / "run"


def test_atomic_directory_replaces_a_file_target(tmp_path):
    target = tmp_path / "out"
    target.write_text("old")
    with atomic_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert (target / "new.txt").read_text() == "new"


@pytest.mark.parametrize(("umask", "file", "folder"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_atomic_writes_follow_the_umask(tmp_path, umask, file, folder):
    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "a")
        with atomic_file(tmp_path / "b.bin") as tmp:
            tmp.write_bytes(b"b")
        with atomic_directory(tmp_path / "c") as tmp:
            (tmp / "d.txt").write_text("d")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert modes == {"a.txt": file, "b.bin": file, "c": folder, "d.txt": file}


@pytest.mark.slow
def test_what_prepare_fit_export_eval_and_analyze_write_is_readable_by_others_under_umask_022(
    tmp_path, monkeypatch, umask_022
):
    from moe_lit.checkpoint import export_model, load_model
    from moe_lit.console_script import main
    from tests.helpers.cli_runs import TINY
    from tests.helpers.corpus import prepare_corpus
    from tests.helpers.paths import EXPERIMENT

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = prepare_corpus(tmp_path, paragraphs=20, val_fraction=0.1, test_fraction=0.1)
    fit = ["fit", "--config", EXPERIMENT, "--data.data_dir", str(data), *TINY, "--trainer.max_steps", "1"]
    assert main([*fit, "--out", "run"]) == 0
    ours = export_model(load_model("run/checkpoints/last.ckpt"), tmp_path / "ours", data / "tokenizer.json")
    assert main(["export", "--checkpoint", str(ours), "--format", "mixtral", "--out", "hf"]) == 0
    evaluate = ["eval", "--checkpoint", str(ours), "--tasks", "moe_lit_pairs", "--limit", "2", "--bootstrap-iters", "0"]
    assert main([*evaluate, "--data", str(data), "--out", "eval"]) == 0
    assert main(["analyze", "routing", "--checkpoint", str(ours), "--data", str(data), "--out", "analysis"]) == 0
    outputs = [data, tmp_path / "run", ours, tmp_path / "hf", tmp_path / "eval", tmp_path / "analysis"]
    assert all(path.exists() for path in outputs)
    assert unreadable_by_others(*outputs) == []
