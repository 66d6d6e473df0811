"""Gradient clipping of sharded models: one gloo process of ``clip_grad_norm`` under FSDP1 and FSDP2.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/distributed/grad_norm_script.py --out DIR

Every rank takes the same full batch, so the averaged gradients are the one-process gradients.
``clip_grad_norm`` (max norm ``MAX_NORM``, below the gradients' norm) then runs on the FSDP1 root
(its flat shards) and on the FSDP2 model (DTensor shards); rank 0 writes, per strategy, the norm it
returned and every clipped gradient gathered by parameter name -> ``DIR/clipped.pt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_lit.distributed.grad_norm import clip_grad_norm  # noqa: E402
from moe_lit.distributed.sharding import apply_fsdp2  # noqa: E402
from moe_lit.model import Transformer  # noqa: E402
from moe_lit.model.transformer import Block  # noqa: E402
from tests.distributed.train_script import CONFIG, tokens  # noqa: E402

MAX_NORM = 0.05


def backward(model: torch.nn.Module) -> None:
    batch_BL1 = tokens().tensors[0][:8]
    out = model(batch_BL1[:, :-1], batch_BL1[:, 1:])
    (out.ce + sum(out.aux_losses.values())).backward()


def fsdp1() -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        Transformer(CONFIG),
        device_id=torch.device("cpu"),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
    )
    backward(model)
    norm = clip_grad_norm(model.parameters(), MAX_NORM, root=model)
    with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        grads = {name.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for name, p in model.named_parameters()}
    return {"norm": float(norm), "grads": grads}


def fsdp2() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = Transformer(CONFIG)
    apply_fsdp2(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    backward(model)
    norm = clip_grad_norm(model.parameters(), MAX_NORM, root=model)
    return {"norm": float(norm), "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {"fsdp1": fsdp1(), "fsdp2": fsdp2()}
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(results, args.out / "clipped.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
