"""Output head + cross-entropy forward+backward: the chunked ``linear_cross_entropy`` vs plain logits.

    .venv/bin/python -m benchmarks.head_loss [--rounds 9] [--threads 2] [--clock wall]

The shapes of ``train_step.py`` (2048 tokens, d_model 256, vocab 8192, fp32). Cases, timed
INTERLEAVED in one process: ``chunk_0`` (``F.linear`` + ``F.cross_entropy`` on the full (2048, 8192)
logits) and ``chunk_<C>`` for several chunk sizes C of ``moe_lit.model.loss.linear_cross_entropy``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.common import CLOCKS, interleaved_times, median, paired_ratio, report, set_threads
from benchmarks.train_step import BATCH, D_MODEL, SEQ, VOCAB
from moe_lit.model.loss import linear_cross_entropy

CHUNKS = (0, 128, 256, 512, 1024)


def head_loss_step(chunk_tokens: int) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    x_ND = torch.randn(BATCH * SEQ, D_MODEL, generator=gen).requires_grad_(True)
    weight_VD = (0.05 * torch.randn(VOCAB, D_MODEL, generator=gen)).requires_grad_(True)
    targets_N = torch.randint(0, VOCAB, (BATCH * SEQ,), generator=gen)

    def step() -> None:
        x_ND.grad = weight_VD.grad = None
        linear_cross_entropy(x_ND, weight_VD, targets_N, chunk_tokens).backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    cases = {f"chunk_{c}": head_loss_step(c) for c in CHUNKS}
    times = interleaved_times(cases, rounds=args.rounds, warmup=args.warmup, clock=args.clock)
    result = {
        "setup": {
            "tokens": BATCH * SEQ,
            "d_model": D_MODEL,
            "vocab": VOCAB,
            "rounds": args.rounds,
            "clock": args.clock,
        },
        "median_ms": {name: 1e3 * median(t) for name, t in times.items()},
        "time_over_plain": {name: paired_ratio(times, name, "chunk_0") for name in times},
    }
    report("head_loss", result, save=not args.no_save)


if __name__ == "__main__":
    main()
