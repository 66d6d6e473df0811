"""scripts/patch_gpu_sdists.py: the CUDA 13 patch of megablocks' cumsum.h and the CUDA wheels' include folders."""

import importlib.util
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

# NOTE: megablocks 0.10.0's csrc/cumsum.h passes CUB's removed argument in this form (twice).
CALL = """    CUDA_CALL(cub::DeviceScan::{kind}Sum(d_temp_storage,
\t\t\t\t\t    temp_storage_bytes,
\t\t\t\t\t    d_in,
\t\t\t\t\t    d_out,
\t\t\t\t\t    num_items,
\t\t\t\t\t    stream,
\t\t\t\t\t    debug_synchronous));
"""
SIGNATURE = "\t\t  bool debug_synchronous = false) {\n"


def load_script():
    spec = importlib.util.spec_from_file_location("patch_gpu_sdists", REPO / "scripts" / "patch_gpu_sdists.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_cumsum(build: Path) -> Path:
    path = build / "megablocks-0.10.0" / "csrc" / "cumsum.h"
    path.parent.mkdir(parents=True)
    path.write_text(SIGNATURE + CALL.format(kind="Exclusive") + SIGNATURE + CALL.format(kind="Inclusive"))
    return path


def test_cumsum_loses_the_argument_once_and_keeps_its_signature(tmp_path, capsys):
    script = load_script()
    path = write_cumsum(tmp_path)
    assert script.main([str(tmp_path)]) == 0
    patched = path.read_text()
    assert "debug_synchronous)" not in patched
    assert patched.count("stream));") == 2
    assert patched.count(SIGNATURE) == 2
    assert "2 place(s)" in capsys.readouterr().out
    assert script.main([str(tmp_path)]) == 0
    assert path.read_text() == patched
    assert "0 place(s)" in capsys.readouterr().out


def test_a_missing_sdist_is_reported_and_skipped(tmp_path, capsys):
    assert load_script().main([str(tmp_path)]) == 0
    assert "skipped megablocks-0.10.0/csrc/cumsum.h: not there" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["no-such-folder"], ["a", "b"]])
def test_bad_arguments_exit_2_with_the_usage(argv, capsys):
    assert load_script().main(argv) == 2
    assert "usage: python scripts/patch_gpu_sdists.py BUILD_DIR" in capsys.readouterr().err


def test_cuda_includes_are_every_nvidia_include_folder_of_the_site(tmp_path, monkeypatch, capsys):
    script = load_script()
    for folder in ("nvidia/cu13/include", "nvidia/cudnn/include", "nvidia/cu13/lib"):
        (tmp_path / folder).mkdir(parents=True)
    monkeypatch.setattr(script.site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(script.site, "getusersitepackages", lambda: str(tmp_path / "absent"))
    assert script.main(["--cuda-includes"]) == 0
    expected = f"{tmp_path}/nvidia/cu13/include:{tmp_path}/nvidia/cudnn/include"
    assert capsys.readouterr().out.strip() == expected
