"""The experts-backend protocol and ``moe.backend: auto`` by device.

The machine a GPU user has is simulated on CPU: ``torch.cuda.is_available()`` says True and megablocks
imports (its real sdist sources, ``tests/gpu/megablocks_standins``) with stand-in kernels that refuse
CPU tensors as its CUDA extension does (``TORCH_CHECK(x.is_cuda())``). There a model built with
``backend: auto`` gets MegaBlocks experts, and on CPU tensors it trains, evaluates and generates
exactly as the torch backend does, with the torch backend's state-dict keys.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch._dynamo.utils import counters

from moe_lit.config import BACKENDS as CONFIG_BACKENDS
from moe_lit.errors import MoeLitError
from moe_lit.inference.generate import generate
from moe_lit.inference.sparsity import SparseExperts, ffn_modules
from moe_lit.model import Transformer
from moe_lit.model.experts import BACKENDS, ExpertsBackend, TorchExperts
from moe_lit.model.experts.layout import ExpertLayout
from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts
from moe_lit.model.experts.protocol import backend_registry
from moe_lit.model.mlp import SwiGLU
from moe_lit.registry import UnknownName
from tests.gpu import megablocks_standins
from tests.helpers.models import tiny

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# NOTE: MegaBlocks' dMoE layer needs num_experts * expert_size >= 128 (its sparse block size).
MOE = dict(num_experts=4, expert_size=32, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01)
KERNELS = {
    "megablocks_ops": ("sort", "histogram", "inclusive_cumsum", "exclusive_cumsum", "replicate_forward"),
    "megablocks.backend.kernels": ("gather", "scatter", "scatter_wgrad"),
}


def _refuse_cpu(kernel):
    """The kernel, refusing non-CUDA tensors with the RuntimeError of megablocks' TORCH_CHECK."""

    @functools.wraps(kernel)
    def checked(*args, **kwargs):
        if any(isinstance(a, torch.Tensor) and not a.is_cuda for a in (*args, *kwargs.values())):
            raise RuntimeError("Expected x.is_cuda() to be true, but got false.")
        return kernel(*args, **kwargs)

    return checked


@contextlib.contextmanager
def cuda_machine_with_megablocks() -> Iterator[None]:
    """CUDA "available", megablocks importable, its kernels refusing CPU tensors (undone after)."""
    with megablocks_standins.installed(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(MegaBlocksExperts, "kernel_device_types", ("cuda",))
        for module, names in KERNELS.items():
            for name in names:
                mp.setattr(sys.modules[module], name, _refuse_cpu(getattr(sys.modules[module], name)))
        gmm = sys.modules["grouped_gemm"].ops
        mp.setattr(gmm, "gmm", _refuse_cpu(gmm.gmm))
        yield


@pytest.fixture
def gpu_machine():
    with cuda_machine_with_megablocks():
        yield


def _pair(**fields) -> tuple[Transformer, Transformer]:
    """A torch-backend model and the ``fields`` model holding the same weights (loaded strictly)."""
    torch.manual_seed(0)
    reference = Transformer(tiny(**MOE, backend="torch"))
    model = Transformer(tiny(**MOE, **fields))
    model.load_state_dict(reference.state_dict(), strict=True)
    return reference, model


def _train(model: Transformer, tokens_BL: torch.Tensor, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        out = model(tokens_BL[:, :-1], tokens_BL[:, 1:])
        loss = out.ce + out.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_auto_on_a_gpu_machine_trains_evaluates_and_generates_on_cpu_as_the_torch_backend(gpu_machine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: MegaBlocks was chosen
        reference, model = _pair()
    assert all(isinstance(block.ffn.experts, MegaBlocksExperts) for block in model.blocks)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert ffn_modules(model).keys() == ffn_modules(reference).keys()
    # the stand-in kernels refuse CPU tensors, as megablocks' CUDA extension does
    experts, x_TD = model.blocks[0].ffn.experts, torch.randn(6, 32)
    with pytest.raises(RuntimeError, match=r"Expected x.is_cuda\(\) to be true"):
        experts._kernel_forward(x_TD, torch.ones(6, 2) / 2, torch.zeros(6, 2, dtype=torch.long))

    tokens_BL = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = [_train(m, tokens_BL, steps=3) for m in (reference, model)]
    assert losses[1] == losses[0] and losses[0][-1] < losses[0][0]
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    with torch.no_grad():
        evals = [m.eval()(tokens_BL[:, :-1], tokens_BL[:, 1:]).ce for m in (reference, model)]
    assert torch.equal(evals[1], evals[0])
    prompts = [[1, 2, 3], [4, 5]]
    assert generate(model, prompts, max_new_tokens=5) == generate(reference, prompts, max_new_tokens=5)


def test_forced_megablocks_on_cpu_tensors_is_a_one_line_error(gpu_machine):
    _, model = _pair(backend="megablocks")
    assert isinstance(model.blocks[0].ffn.experts, MegaBlocksExperts)
    with pytest.raises(MoeLitError) as error:
        model(torch.zeros(1, 4, dtype=torch.long))
    assert str(error.value) == (
        "moe.backend: 'megablocks' cannot run this layer: the layer's tensors are on cpu "
        "(MegaBlocks' kernels take CUDA tensors only); use backend: auto or torch"
    )


@pytest.mark.slow
def test_a_compiled_block_on_cpu_has_no_graph_break():
    # NOTE: only the CUDA path of MegaBlocksExperts is eager under torch.compile. The model is
    # compiled outside the simulation, whose fake CUDA dynamo would ask for its RNG state.
    with cuda_machine_with_megablocks():
        _, model = _pair()
    block = model.blocks[0]
    assert isinstance(block.ffn.experts, MegaBlocksExperts)
    # NOTE: dynamo's cache outlives a test; a block of the same shapes compiled earlier on this
    # xdist worker would be reused and compile no frame here.
    torch._dynamo.reset()
    block.compile(backend="aot_eager")
    counters.clear()
    out, losses = block(torch.randn(2, 8, 32))
    (out.sum() + sum(losses.values())).backward()
    assert counters["frames"]["total"] > 0 and not counters["graph_break"], dict(counters["graph_break"])


def test_the_stand_ins_of_tests_gpu_run_megablocks_kernels_on_cpu():
    # NOTE: what makes tests/gpu's reference tests compare MegaBlocks' code, not the torch fallback.
    with megablocks_standins.installed(), pytest.MonkeyPatch.context() as mp:
        calls = []
        sort = sys.modules["megablocks_ops"].sort
        mp.setattr(sys.modules["megablocks_ops"], "sort", lambda *args: calls.append(1) or sort(*args))
        experts = MegaBlocksExperts(32, tiny(**MOE).moe)
        experts(torch.randn(6, 32), torch.ones(6, 2) / 2, torch.zeros(6, 2, dtype=torch.long), None)
    assert calls


def test_supports_gives_the_reason(gpu_machine):
    uniform, unequal, capped = tiny(**MOE).moe, tiny(expert_size=[8, 16, 16, 24]).moe, tiny(capacity_factor=1.0).moe
    for cfg in (uniform, unequal, capped):
        assert TorchExperts.supports(cfg, CPU) is None and TorchExperts.supports(cfg, CUDA) is None
    assert MegaBlocksExperts.supports(uniform, CUDA) is None
    assert MegaBlocksExperts.supports(uniform, CPU) == (
        "the layer's tensors are on cpu (MegaBlocks' kernels take CUDA tensors only)"
    )
    assert MegaBlocksExperts.supports(unequal, CUDA).startswith("heterogeneous expert sizes")
    assert MegaBlocksExperts.supports(capped, CUDA).startswith("capacity_factor is set")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_supports_names_the_missing_cuda_device():
    reason = MegaBlocksExperts.supports(tiny(**MOE).moe, CUDA)
    assert reason == "no CUDA device (MegaBlocks' kernels are CUDA only)"


def test_the_registry_refuses_a_taken_name():
    with pytest.raises(ValueError, match=r"^experts backend name 'torch' of TorchExperts is taken by TorchExperts$"):
        backend_registry(TorchExperts, TorchExperts)

    class Auto(TorchExperts):
        name = "auto"

    with pytest.raises(ValueError, match=r"^experts backend name 'auto' of Auto is reserved$"):
        backend_registry(Auto)
    assert list(BACKENDS) == ["megablocks", "torch"]  # auto's order of preference
    assert set(CONFIG_BACKENDS) == {"auto", *BACKENDS}  # moe.backend's allowed values
    with pytest.raises(TypeError):
        BACKENDS["other"] = TorchExperts  # type: ignore[index]
    with pytest.raises(UnknownName, match=r"^experts backend: unknown name 'other', registered: megablocks, torch$"):
        BACKENDS["other"]


def test_the_protocol_is_what_backends_implement():
    experts = TorchExperts(32, ExpertLayout.of([8, 16]))
    assert isinstance(experts, ExpertsBackend) and experts.expert_parallel_group is None
    thresholds_E = torch.zeros(2)
    assert not isinstance(SparseExperts(experts, thresholds_E, "gate"), ExpertsBackend)
    assert not isinstance(SwiGLU(32, 8), ExpertsBackend)
    with pytest.raises(MoeLitError, match=r"^strategy.expert_parallel_size: 2 needs the MegaBlocks backend"):
        experts.shard_experts(type("Mesh", (), {"size": lambda self: 2})())
