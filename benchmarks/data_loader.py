"""Training data loader tokens/s vs the training step's token consumption (goal: >= 20x).

    .venv/bin/python -m benchmarks.data_loader [--text-dir DIR | --data-dir PREPARED] [--threads 2]

Without a directory, a small local corpus is written first: the docstrings of the Python standard
library's source files (read with ``ast``, nothing imported), one folder per "language" (module
docstrings / class and function docstrings), then prepared with ``moe-lit data prepare``. The
loader is ``MoEDataModule(...).train_dataloader()`` (litdata, seq 256, batch 8); the consumer is
a full training step of our MoE model for each shape of ``train_step.py``. Both are timed
INTERLEAVED in one process; tokens are counted as B*L consumed inputs per batch.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks.common import interleaved_times, median, paired_ratio, report, set_threads
from benchmarks.train_step import BATCH, SEQ, SHAPES, our_config, step_fn

LOADER_BATCHES = 50
"""Batches drawn per timed loader call (one batch is far shorter than one training step)."""


def _docstrings(path: Path) -> Iterator[tuple[str, str]]:
    """``(kind, docstring)`` of a Python source file: kind 'module' or 'member'."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield ("module" if isinstance(node, ast.Module) else "member"), doc


def write_stdlib_corpus(root: Path) -> Path:
    """``root/<lang>/*.txt`` from the standard library's docstrings (paragraphs split on blank lines)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: dict[str, list[str]] = {"module": [], "member": []}
    for path in sorted(stdlib.glob("*.py")):
        for kind, doc in _docstrings(path):
            texts[kind].append(doc)
    for kind, docs in texts.items():
        (root / kind).mkdir(parents=True, exist_ok=True)
        (root / kind / "docstrings.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return root


def prepare(text_dir: Path, out: Path) -> Path:
    """Run ``moe-lit data prepare`` on a local text folder."""
    cmd = [
        sys.executable,
        "-m",
        "moe_lit.console_script",
        "data",
        "prepare",
        "--source",
        str(text_dir),
        "--out",
        str(out),
        "--quiet",
    ]
    subprocess.run(cmd, check=True)
    return out


def loader_fn(data_dir: Path) -> Callable[[], None]:
    """Draw ``LOADER_BATCHES`` batches from the training loader, restarting the epoch when it ends."""
    from moe_lit.lit.datamodule import MoEDataModule

    loader = MoEDataModule(str(data_dir), seq_len=SEQ, batch_size=BATCH).train_dataloader()
    state = {"it": iter(loader)}

    def draw() -> None:
        for _ in range(LOADER_BATCHES):
            try:
                next(state["it"])
            except StopIteration:
                state["it"] = iter(loader)
                next(state["it"])

    return draw


def main() -> None:
    from moe_lit.model.transformer import Transformer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text-dir", type=Path, help="local corpus DIR/<lang>/*.txt to prepare first")
    source.add_argument("--data-dir", type=Path, help="an already prepared directory")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="moe_lit_data_bench_") as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            text_dir = args.text_dir or write_stdlib_corpus(Path(tmp) / "text")
            data_dir = prepare(text_dir, Path(tmp) / "prepared")
        cases: dict[str, Callable[[], None]] = {"loader": loader_fn(data_dir)}
        for shape in SHAPES:
            model = Transformer(our_config(shape, d_ff=shape[1] * shape[2]))
            cases["train_step_E{}k{}F{}".format(*shape)] = step_fn(model, hf=False)
        times = interleaved_times(cases, rounds=args.rounds, warmup=1)
    tokens_per_batch = BATCH * SEQ
    loader_rate = LOADER_BATCHES * tokens_per_batch / median(times["loader"])
    steps = {}
    for name in cases:
        if name == "loader":
            continue
        steps[name] = {
            "tokens_per_s": tokens_per_batch / median(times[name]),
            # loader tokens/s over step tokens/s = step time / time per loader batch
            "loader_over_step_rate": LOADER_BATCHES * paired_ratio(times, name, "loader"),
        }
    report(
        "data_loader",
        {
            "setup": {
                "seq": SEQ,
                "batch": BATCH,
                "loader_batches_per_call": LOADER_BATCHES,
                "rounds": args.rounds,
                "data": str(args.data_dir or args.text_dir or "stdlib docstrings"),
            },
            "loader_tokens_per_s": loader_rate,
            "train_steps": steps,
            "goal_loader_over_step_rate": 20,
        },
        save=not args.no_save,
    )


if __name__ == "__main__":
    main()
