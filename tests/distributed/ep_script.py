"""Expert parallelism on CPU: one gloo process of an expert-parallel run, against one full-model process.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/distributed/ep_script.py --ep 2 --out DIR

Shape legend: B batch rows, L sequence, V vocab, D d_model.

Every process runs MegaBlocks' real Python code (``megablocks_standins``: its sdist sources, plain-torch
kernels, real ``all_to_all`` on gloo): a tiny MoE Transformer whose MegaBlocks experts are split over
``--ep`` consecutive ranks (``apply_expert_parallel``) and sharded with FSDP2 exactly as
``FSDP2Strategy`` does (``apply_fsdp2`` with the expert-data-parallel mesh). Rank r trains on rows
``r*B:(r+1)*B`` of a fixed global batch. The same process also runs the reference: the full model
(torch backend, one process) on every rank's rows, with the loss averaged over ranks, i.e. what data
parallelism computes. Written to DIR:

* ``diffs<rank>.json``: max |difference| of this rank's logits, MoE layer outputs, CE and aux losses,
  every parameter's gradient (gathered to full) and, for one MoE layer, of MegaBlocks' own
  expert-parallel ``dMoE`` (``parallel_forward_once``) output against our adapter's;
* ``ep_state.pt`` / ``ref_state.pt`` (rank 0): the EP run's full state dict (after one SGD step)
  and the reference's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moe_lit.config import ModelConfig, MoEConfig  # noqa: E402
from moe_lit.distributed.mesh import apply_expert_parallel, expert_parallel_mesh  # noqa: E402
from moe_lit.distributed.sharding import apply_fsdp2  # noqa: E402
from moe_lit.model import Transformer  # noqa: E402
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts, megablocks_arguments  # noqa: E402
from moe_lit.model.moe import MoELayer  # noqa: E402
from tests.gpu import megablocks_standins  # noqa: E402

# NOTE: MegaBlocks' dMoE needs num_experts * expert_size >= 128 (its sparse block size).
CONFIG = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    seq_len=8,
    d_ff=64,
    moe=MoEConfig(num_experts=4, expert_size=32, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01, backend="torch"),
)
ROWS_PER_RANK = 2
LR = 0.5


def reference_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG)


def use_megablocks(model: Transformer) -> None:
    """Swap every MoE layer's torch experts for MegaBlocks experts holding the same weights."""
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            experts = MegaBlocksExperts(CONFIG.d_model, CONFIG.moe, layer.num_moe_layers, device=torch.device("cpu"))
            experts.load_state_dict(layer.experts.state_dict(), strict=True)
            layer.experts = experts


def global_batch(world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, CONFIG.vocab_size, (world * ROWS_PER_RANK, CONFIG.seq_len + 1), generator=gen)


def run(model: Transformer, tokens_BL1: torch.Tensor) -> dict:
    """Forward: logits, MoE layer outputs (forward hooks), CE, aux losses, total loss."""
    outputs = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: outputs.append(out[0]))
        for m in model.modules()
        if isinstance(m, MoELayer)
    ]
    out = model(tokens_BL1[:, :-1])
    for hook in hooks:
        hook.remove()
    ce = F.cross_entropy(out.logits_BLV.flatten(0, 1), tokens_BL1[:, 1:].flatten())
    return {"logits": out.logits_BLV, "moe": outputs, "ce": ce, "aux": out.aux_losses, "loss": ce + out.aux_loss}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def dmoe_diff(ep_mesh, rank: int) -> float:
    """MegaBlocks' own expert-parallel dMoE against our adapter, on this rank's tokens of one layer."""
    import megablocks

    layer = reference_model().blocks[0].ffn
    wrapper = torch.nn.Module()
    wrapper.layer = copy.deepcopy(layer)
    use_megablocks(wrapper)
    apply_expert_parallel(wrapper, ep_mesh)
    group = ep_mesh.get_group()
    args = megablocks_arguments(
        CONFIG.d_model, CONFIG.moe, layer.num_moe_layers, device=torch.device("cpu"), expert_parallel_group=group
    )
    dmoe = megablocks.layers.dmoe.dMoE(args)
    rows = CONFIG.moe.total_expert_size // ep_mesh.size()
    state = {
        name: value[ep_mesh.get_local_rank() * rows :][:rows] if name.startswith("experts.mlp.") else value
        for name, value in layer.state_dict().items()
    }
    dmoe.load_state_dict(state, strict=True)
    torch.manual_seed(10 + rank)
    x_BLD = torch.randn(ROWS_PER_RANK, CONFIG.seq_len, CONFIG.d_model)
    ours, _ = wrapper.layer(x_BLD)
    theirs = dmoe(x_BLD.transpose(0, 1).contiguous()).transpose(0, 1)  # MegaBlocks' [sl, bs, hs]
    megablocks.layers.moe.clear_load_balancing_loss()
    megablocks.layers.router.clear_router_zloss()
    return max_diff(ours, theirs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    with megablocks_standins.installed():
        ref = reference_model()
        model = copy.deepcopy(ref)
        use_megablocks(model)
        ep_mesh = expert_parallel_mesh("cpu", world, args.ep)
        apply_expert_parallel(model, ep_mesh["expert_parallel"])
        apply_fsdp2(model, init_device_mesh("cpu", (world,)), experts_mesh=ep_mesh["expert_data_parallel"])
        local_rows = {
            name: tuple(p.to_local().shape) for name, p in model.named_parameters() if ".experts.mlp." in name
        }

        tokens_BL1 = global_batch(world)
        ours = run(model, tokens_BL1[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK])
        ours["loss"].backward()
        refs = [run(ref, tokens_BL1[r * ROWS_PER_RANK : (r + 1) * ROWS_PER_RANK]) for r in range(world)]
        (sum(r["loss"] for r in refs) / world).backward()
        mine = refs[rank]

        diffs = {"logits": max_diff(ours["logits"], mine["logits"]), "ce": max_diff(ours["ce"], mine["ce"])}
        diffs["moe_outputs"] = max(max_diff(a, b) for a, b in zip(ours["moe"], mine["moe"], strict=True))
        for name, value in mine["aux"].items():
            diffs[f"aux:{name}"] = max_diff(ours["aux"][name], value)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            diffs[f"grad:{name}"] = max_diff(full(p.grad), ref_params[name].grad)
        diffs["dmoe_vs_adapter"] = dmoe_diff(ep_mesh["expert_parallel"], rank)

        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
            for p in ref.parameters():
                p -= LR * p.grad
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "diffs": diffs,
        "local_shapes": local_rows,
        "ep_group_size": ep_mesh["expert_parallel"].size(),
        "ep_rank": ep_mesh["expert_parallel"].get_local_rank(),
    }
    (args.out / f"diffs{rank}.json").write_text(json.dumps(report, indent=1))
    if rank == 0:
        torch.save(state, args.out / "ep_state.pt")
        torch.save(ref.state_dict(), args.out / "ref_state.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
