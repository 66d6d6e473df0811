"""Expert parallelism on CPU: gloo processes running MegaBlocks' real dMoE code against one full-model process.

``ep_script.py`` (one subprocess per rank) does the distributed part; here we check what it wrote:
outputs, losses and every gradient equal the single-process model's, MegaBlocks' own expert-parallel
dMoE agrees with our adapter, each rank holds only its experts' rows, and the full state dict the EP
run saves is the single-process layout that the CPU torch backend loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_lit.distributed.mesh import apply_expert_parallel, expert_parallel_mesh
from moe_lit.errors import MoeLitError
from moe_lit.lit.strategies import FSDP2Strategy
from moe_lit.model import Transformer
from moe_lit.model.experts import TorchExperts
from tests.distributed import ep_script, launch
from tests.gpu import megablocks_standins

# NOTE: one worker runs the module: its module-scoped runs are then made once, not once per worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("expert_parallel")]
TIMEOUT_S = 300


def run_ranks(world: int, ep: int, out: Path) -> list[dict]:
    megablocks_standins.fetch_sources()  # download once here (or skip), not in every rank
    launch.run_ranks(Path(ep_script.__file__), ["--ep", str(ep), "--out", str(out)], world, TIMEOUT_S)
    return [json.loads((out / f"diffs{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[(2, 2), (4, 2)], ids=["world2-ep2", "world4-ep2-dp2"])
def ep_run(request, tmp_path_factory):
    world, ep = request.param
    out = tmp_path_factory.mktemp(f"ep-{world}-{ep}")
    return world, ep, out, run_ranks(world, ep, out)


def test_outputs_losses_and_gradients_match_one_process(ep_run):
    _, ep, _, reports = ep_run
    for rank, report in enumerate(reports):
        diffs = report["diffs"]
        expert_grads = [k for k in diffs if k.startswith("grad:") and ".experts.mlp." in k]
        assert len(expert_grads) == 3 * len(ep_script.CONFIG.moe_layer_ids)
        assert {"logits", "moe_outputs", "ce", "aux:load_balancing", "aux:z_loss"} <= diffs.keys()
        bad = {k: v for k, v in diffs.items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        # MegaBlocks' own parallel_forward_once gives our adapter's output
        assert diffs["dmoe_vs_adapter"] <= 1e-6
        assert report["ep_group_size"] == ep and report["ep_rank"] == rank % ep


def test_each_rank_holds_only_its_experts(ep_run):
    world, ep, _, reports = ep_run
    moe = ep_script.CONFIG.moe
    # expert-parallel rows (E/ep experts), further sharded by FSDP2 over the world/ep replicas
    rows = moe.total_expert_size // ep // (world // ep)
    for report in reports:
        assert set(map(tuple, report["local_shapes"].values())) == {(rows, ep_script.CONFIG.d_model)}


def test_saved_state_is_the_one_layout_and_loads_into_the_torch_backend(ep_run):
    _, _, out, _ = ep_run
    ours = torch.load(out / "ep_state.pt", weights_only=True)
    ref = torch.load(out / "ref_state.pt", weights_only=True)
    assert ours.keys() == ref.keys()
    untrained = ep_script.reference_model().state_dict()
    for name, value in ref.items():
        assert ours[name].shape == value.shape, name
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(ours["blocks.1.ffn.experts.mlp.w2"], untrained["blocks.1.ffn.experts.mlp.w2"])  # trained

    model = Transformer(ep_script.CONFIG)
    model.load_state_dict(ours, strict=True)
    assert isinstance(model.blocks[0].ffn.experts, TorchExperts)
    reference = Transformer(ep_script.CONFIG)
    reference.load_state_dict(ref, strict=True)
    tokens_BL = ep_script.global_batch(2)[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens_BL).logits_BLV, reference(tokens_BL).logits_BLV, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_expert_parallel_size_is_validated(value):
    with pytest.raises(MoeLitError, match="strategy.expert_parallel_size: must be an integer >= 1"):
        FSDP2Strategy(expert_parallel_size=value)


def test_expert_parallel_size_must_divide_the_world():
    with pytest.raises(MoeLitError, match="strategy.expert_parallel_size: 3 does not divide the world size 4"):
        expert_parallel_mesh("cpu", 4, 3)


class _Mesh:
    def size(self) -> int:
        return 2


def test_expert_parallelism_needs_the_megablocks_backend():
    model = ep_script.reference_model()
    with pytest.raises(
        MoeLitError,
        match=r"^strategy.expert_parallel_size: 2 needs the MegaBlocks backend \(moe.backend: megablocks\); "
        r"the torch backend keeps every expert on every rank$",
    ):
        apply_expert_parallel(model, _Mesh())
