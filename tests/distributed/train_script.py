"""Train a tiny MoE with one strategy on CPU, then save a checkpoint: run as a script, not under pytest.

    python tests/distributed/train_script.py --strategy ddp --steps 2 --out DIR [--resume CKPT]
        [--accumulate 2 --bias --compile]

Lightning's launcher re-runs this command line for rank 1, so the distributed tests start it as a
subprocess. Every run sees the same global batches: 8 fixed sequences per step, split across the ranks
in order (``RankShard``). The router's auxiliary losses are off, so a data-parallel
step computes exactly the single-process gradient (the balancing loss is not linear in the batch).
The checkpoint goes to ``DIR/model.ckpt``. With ``--accumulate N`` every rank splits its share of a
global batch into N micro-batches; ``--bias`` trains with ``balancing: bias``; ``--compile`` compiles
the blocks (``CompileBlocks``, inductor). Every rank also saves
its routers' buffers (selection biases, last step's statistics) to ``DIR/routers_rank<r>.pt`` and,
with ``--compile``, its compiled block and dynamo frame counts to ``DIR/compiled_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_lit.callbacks.compile import CompileBlocks  # noqa: E402
from moe_lit.config import ModelConfig, MoEConfig  # noqa: E402
from moe_lit.lit.module import MoELitModule, OptimConfig  # noqa: E402
from moe_lit.lit.strategies import FSDP2Strategy  # noqa: E402
from moe_lit.model.compile import is_compiled  # noqa: E402

# NOTE: one batch per epoch: a run resumed from a checkpoint saved at max_steps replays the rest of
# its "unfinished" epoch from the loader's start, so only a one-batch epoch gives every run the same data.
GLOBAL_BATCH, SAMPLES = 8, 8
CONFIG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    seq_len=16,
    d_ff=64,
    moe=MoEConfig(num_experts=4, expert_size=16, top_k=2, aux_loss_coef=0.0, first_dense_layers=1),
)


def tokens() -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randint(0, CONFIG.vocab_size, (SAMPLES, CONFIG.seq_len + 1), generator=gen))


class RankShard(Sampler[int]):
    """Indices ``rank, rank + world, ...`` in order, read from torch.distributed when iterated.

    NOTE: Lightning gives training loaders a *shuffling* DistributedSampler; this one keeps the
    global batches of every world size equal to the single-process batches (use_distributed_sampler off).
    """

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def _shard(self) -> range:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return range(rank, self.num_samples, world)

    def __iter__(self) -> Iterator[int]:
        return iter(self._shard())

    def __len__(self) -> int:
        return len(self._shard())


def strategy(name: str):
    if name == "single":
        return "auto", 1
    if name == "ddp":
        return "ddp", 2
    if name == "fsdp2":
        return FSDP2Strategy(), 2
    raise SystemExit(f"--strategy: got {name!r}, allowed values: single, ddp, fsdp2")


BIAS_CONFIG = CONFIG.replace(moe=dataclasses.replace(CONFIG.moe, balancing="bias", bias_update_rate=0.01))


def train(
    strategy_name: str,
    steps: int,
    out: Path,
    resume: Path | None = None,
    accumulate: int = 1,
    bias: bool = False,
    compile: bool = False,
) -> Path:
    """Fit to ``steps`` optimizer steps (from ``resume`` if given); returns the saved checkpoint."""
    pl.seed_everything(0, verbose=False)
    strat, devices = strategy(strategy_name)
    module = MoELitModule(BIAS_CONFIG if bias else CONFIG, OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant"))
    loader = DataLoader(
        tokens(), batch_size=GLOBAL_BATCH // (devices * accumulate), sampler=RankShard(SAMPLES), collate_fn=stack_rows
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strat,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        accumulate_grad_batches=accumulate,
        callbacks=[CompileBlocks()] if compile else [],
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume)
    routers = {n: b.detach().clone() for n, b in module.model.named_buffers() if ".router." in n}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(routers, out / f"routers_rank{trainer.global_rank}.pt")
    if compile:
        from torch._dynamo.utils import counters

        compiled = {"blocks": sum(map(is_compiled, module.model.blocks)), "frames": counters["frames"]["ok"]}
        (out / f"compiled_rank{trainer.global_rank}.json").write_text(json.dumps(compiled))
    trainer.save_checkpoint(out / "model.ckpt")
    return out / "model.ckpt"


def stack_rows(rows: list[tuple[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([row[0] for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--bias", action="store_true")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train(args.strategy, args.steps, args.out, args.resume, args.accumulate, args.bias, args.compile)


if __name__ == "__main__":
    main()
