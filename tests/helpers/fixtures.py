"""Session fixtures shared by several test folders: a prepared dir, a tiny MoE and its export, a bf16 CPU.

The prepared dir follows the data pipeline's contract: ``meta.json``, ``tokenizer.json`` and
``text/<split>/<lang>.jsonl`` with one ``{"id", "doc", "text"}`` per paragraph, parallel ids.
"""

import json
import os
import shutil

import pytest
import torch
from filelock import FileLock

from moe_lit.checkpoint import export_model
from moe_lit.model import Transformer
from tests.helpers.corpus import EOT, LANGUAGES, PARAGRAPHS, paragraph_records, prepare_corpus
from tests.helpers.models import tiny


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory):
    """A prepared data dir: meta.json, a byte-level BPE tokenizer.json, parallel test text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("prepared")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([text for texts in PARAGRAPHS.values() for text in texts], trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "meta.json").write_text(
        json.dumps({"languages": list(LANGUAGES), "vocab_size": tokenizer.get_vocab_size()})
    )
    for lang in LANGUAGES:
        split_dir = root / "text" / "test"
        split_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(record, ensure_ascii=False) for record in paragraph_records(lang)]
        (split_dir / f"{lang}.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_moe(prepared_dir):
    """A seeded tiny MoE Transformer whose vocabulary fits the fixture tokenizer."""
    vocab = json.loads((prepared_dir / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    return Transformer(tiny(vocab_size=vocab, seq_len=32)).eval()


@pytest.fixture(scope="session")
def exported(tmp_path_factory, tiny_moe, prepared_dir):
    """The tiny model exported with its tokenizer (a checkpoint directory)."""
    return export_model(tiny_moe, tmp_path_factory.mktemp("ckpt") / "tiny-moe", prepared_dir / "tokenizer.json")


def built_once(tmp_path_factory, name: str, build):
    """``build(dir)`` run once per test run, its result (a path under ``dir``) copied for the caller.

    NOTE: pytest-xdist gives each worker its own session and basetemp; their parent is the run's, so
    the first worker to ask builds there behind a file lock and every caller gets its own copy (the
    tests may write into it). A run without xdist builds in its own basetemp.
    """
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent
    cache = run_dir / f"built-{name}"
    with FileLock(f"{cache}.lock"):
        if not cache.is_dir():
            partial = cache.with_name(f"{cache.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)  # a build that failed earlier in this run
            build(partial)
            partial.rename(cache)
    copy = tmp_path_factory.mktemp(name)
    shutil.copytree(cache, copy, dirs_exist_ok=True, symlinks=True)
    return copy


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny prepared data dir (vocabulary 300) for ``moe-lit fit`` runs, this module's own copy."""

    def build(root):
        prepare_corpus(root, paragraphs=40, val_fraction=0.1, test_fraction=0.1)

    return built_once(tmp_path_factory, "cli_runs", build) / "data"


@pytest.fixture
def bf16_cpu(monkeypatch, tmp_path):
    """A CPU whose flags list native bf16 (``moe_lit.inference.precision`` reads this cpuinfo)."""
    from moe_lit.inference import precision

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 fma\n\nprocessor\t: 1\n")
    monkeypatch.setattr(precision, "CPUINFO", cpuinfo)


@pytest.fixture
def umask_022():
    """The common umask (group and others may read) for the test, then the previous one again."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def unreadable_by_others(*roots) -> list[str]:
    """Directories others cannot list and enter, and files they cannot read, under ``roots``."""
    found = []
    for root in roots:
        for path in [root, *root.rglob("*")]:
            mode = path.stat().st_mode & 0o777
            wanted = 0o055 if path.is_dir() else 0o044
            if mode & wanted != wanted:
                found.append(f"{oct(mode)} {path}")
    return found
