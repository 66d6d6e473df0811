"""The one overwrite rule (check_output) and atomic directories."""

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory, check_output


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
