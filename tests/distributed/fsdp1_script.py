"""FSDP1 optimizer state across strategies: one gloo process of a raw FSDP1 run (torch's FSDP1 runs on CPU
with ``device_id=torch.device("cpu")``; Lightning's FSDPStrategy does not offer that).

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/distributed/fsdp1_script.py --out DIR

A tiny Transformer, FSDP1-wrapped per Block (``use_orig_params``, as Lightning's FSDPStrategy),
takes one AdamW step (our two parameter groups: decay / no decay) on rank r's half of a fixed batch.
Then, with the very code of ``FSDPStrategy``:

* save: ``FSDPStrategy.optimizer_state`` -> ``DIR/fsdp1_optim.pt`` (rank 0; plain ids, group order);
* load: that plain state into a fresh FSDP1 model and optimizer (``load_full_optimizer_states``), read
  back by name -> ``DIR/reloaded_by_name.pt`` (rank 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_lit.distributed.optim_state import load_full_optimizer_states  # noqa: E402
from moe_lit.lit.optim import OptimConfig, build_optimizer  # noqa: E402
from moe_lit.lit.strategies import FSDPStrategy  # noqa: E402
from moe_lit.model import Transformer  # noqa: E402
from moe_lit.model.transformer import Block  # noqa: E402
from tests.distributed.train_script import CONFIG, tokens  # noqa: E402

OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, schedule="constant")


def fsdp1_model_and_optimizer():
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    wrap = ModuleWrapPolicy({Block})
    model = FullyShardedDataParallel(
        Transformer(CONFIG), device_id=torch.device("cpu"), auto_wrap_policy=wrap, use_orig_params=True
    )
    # NOTE: built after wrapping, as Lightning does: FSDP1 shows the optimizer 1-D shards.
    optimizer, _ = build_optimizer(model, OPTIM, 0)
    return model, optimizer


def train_step(model, optimizer, tokens_BL1: torch.Tensor) -> None:
    logits_BLV = model(tokens_BL1[:, :-1]).logits_BLV
    F.cross_entropy(logits_BLV.flatten(0, 1), tokens_BL1[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def state_by_name(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # NOTE: no cpu_offload: on a CPU model it aliases exp_avg and exp_avg_sq (see full_optimizer_state).
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch_BL1 = tokens().tensors[0]
    mine = batch_BL1.chunk(world)[rank]

    model, optimizer = fsdp1_model_and_optimizer()
    train_step(model, optimizer, mine)
    strategy = FSDPStrategy()
    strategy.model = model
    saved = strategy.optimizer_state(optimizer)

    # every rank loads the full checkpoint, as FSDPStrategy.load_checkpoint does
    shared = [saved]
    dist.broadcast_object_list(shared, src=0)
    fresh_model, fresh_optimizer = fsdp1_model_and_optimizer()
    load_full_optimizer_states(fresh_model, [fresh_optimizer], shared, broadcast_from_rank0=False, strict=True)
    reloaded = state_by_name(fresh_model, fresh_optimizer)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(saved, args.out / "fsdp1_optim.pt")
        torch.save(reloaded, args.out / "reloaded_by_name.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
