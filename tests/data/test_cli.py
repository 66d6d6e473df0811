"""Bad input to ``moe-lit data prepare``: one line on stderr, exit status 2."""

import os
import subprocess
import sys

import pytest

from moe_lit.console_script import main
from moe_lit.data.debian import ensure_package_lists
from moe_lit.errors import MoeLitError

FAKE_APT_CACHE = """#!/bin/sh
printf 'libreoffice-help-common\\nlibreoffice-help-de\\nlibreoffice-help-en-us\\n'
"""
OFFLINE = """#!/bin/sh
echo "E: Failed to fetch http://deb.debian.org/debian/pool/x.deb  Temporary failure resolving 'deb.debian.org'" >&2
exit 100
"""


def _error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def fake_apt(tmp_path, monkeypatch):
    """apt-cache knows de and en-us; apt-get fails like a machine without network."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in {"apt-cache": FAKE_APT_CACHE, "apt-get": OFFLINE, "dpkg": OFFLINE}.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return tmp_path


def test_missing_source(capsys, tmp_path):
    err = _error(capsys, ["data", "prepare", "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "neither 'debian', 'hf:NAME' nor an existing folder" in err


def test_unknown_language_of_a_local_source(capsys, corpus_dir, tmp_path):
    err = _error(
        capsys,
        ["data", "prepare", "--source", str(corpus_dir), "--languages", "en", "xx", "--out", str(tmp_path / "o")],
    )
    assert "unknown code(s) xx" in err and "allowed: de en ru" in err


def test_unknown_language_of_debian(capsys, fake_apt):
    err = _error(capsys, ["data", "prepare", "--languages", "de", "klingon", "--out", str(fake_apt / "o")])
    assert "unknown code(s) klingon" in err and "allowed: de en en-us" in err


def test_apt_offline_shows_the_local_folder_alternative(capsys, fake_apt):
    err = _error(
        capsys,
        [
            "data",
            "prepare",
            "--languages",
            "de",
            "--out",
            str(fake_apt / "o"),
            "--cache-dir",
            str(fake_apt / "cache"),
            "--quiet",
        ],
    )
    assert "offline" in err and "--source DIR" in err
    assert not (fake_apt / "o").exists()


def test_apt_missing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    err = _error(capsys, ["data", "prepare", "--out", str(tmp_path / "o")])
    assert "needs apt-get, apt-cache, dpkg" in err and "--source DIR" in err


def test_empty_package_lists_without_root(tmp_path):
    with pytest.raises(MoeLitError, match="apt package lists are empty .* run 'sudo apt-get update' first"):
        ensure_package_lists(tmp_path, is_root=False)


def test_tokenizer_vocab_mismatch(capsys, prepared, corpus_dir, tmp_path):
    err = _error(
        capsys,
        [
            "data",
            "prepare",
            "--source",
            str(corpus_dir),
            "--tokenizer",
            str(prepared / "tokenizer.json"),
            "--vocab-size",
            "999",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert "tokenizer/vocab mismatch" in err and "999" in err


def test_bad_vocab_size(capsys, corpus_dir, tmp_path):
    err = _error(
        capsys, ["data", "prepare", "--source", str(corpus_dir), "--vocab-size", "100", "--out", str(tmp_path / "o")]
    )
    assert "vocab_size: must be an integer >= 257" in err


def test_hf_source_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_lit.console_script",
            "data",
            "prepare",
            "--source",
            "hf:some/corpus",
            "--languages",
            "de",
            "--out",
            str(tmp_path / "o"),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "hf:some/corpus" in proc.stderr and "offline" in proc.stderr
