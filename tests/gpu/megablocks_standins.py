"""Run MegaBlocks' real Python code on CPU: its sdist sources plus plain-torch stand-ins for its kernels.

Shape legend: T tokens, D d_model, K top-k, N = T*K routed assignments (in MegaBlocks' sorted order).

``pip download`` fetches the megablocks 0.10.0 and stanford-stk 0.7.1 sdists (a few seconds, cached
under ``$MOE_LIT_CACHE`` or ``~/.cache/moe_lit``); their Python packages go on ``sys.path`` and the
compiled/Triton pieces are replaced by modules written here from the kernels' documented semantics:

* ``megablocks_ops`` (CUDA extension): stable key sort with its permutation, histogram, cumsums,
  replicate (the expert-parallel path);
* ``megablocks.backend.kernels`` (Triton): ``gather`` / ``scatter`` / ``scatter_wgrad`` (unpadded);
* ``grouped_gemm``: ``ops.gmm`` as one matmul per expert;
* ``stk.backend.triton_kernels`` (Triton, only used by the sparse path): empty.

Everything else (``Arguments``, ``dMoE``, ``LearnedRouter``, ``GroupedGLU``, the autograd functions
around the kernels, the module-global loss lists) is MegaBlocks' own code.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import tarfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_lit.model.experts.megablocks_backend import MegaBlocksExperts

SDISTS = {"megablocks-0.10.0": "megablocks==0.10.0", "stanford_stk-0.7.1": "stanford-stk==0.7.1"}
STANDIN_MODULES = ("megablocks_ops", "grouped_gemm", "megablocks.backend.kernels", "stk.backend.triton_kernels")


def cache_dir() -> Path:
    return Path(os.environ.get("MOE_LIT_CACHE", Path.home() / ".cache" / "moe_lit")) / "megablocks-src"


def fetch_sources() -> list[Path]:
    """Source roots of the two sdists (downloaded once); skips the test when pip cannot fetch them."""
    root = cache_dir()
    roots = [root / name for name in SDISTS]
    if all(r.is_dir() for r in roots):
        return roots
    root.mkdir(parents=True, exist_ok=True)
    # NOTE: megablocks' setup.py asks the GPU for its arch unless TORCH_CUDA_ARCH_LIST is set, and
    # --no-build-isolation reads the metadata with the installed torch instead of fetching torch 2.7.
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0"}
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation", "-d", str(root)]
    try:
        done = subprocess.run([*cmd, *SDISTS.values()], env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("pip download of the megablocks 0.10.0 / stanford-stk 0.7.1 sdists timed out")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"cannot pip download the megablocks 0.10.0 / stanford-stk 0.7.1 sdists: {last}")
    for name in SDISTS:
        with tarfile.open(root / f"{name}.tar.gz") as tar:
            tar.extractall(root, filter="data")
    return roots


# ---------------------------------------------------------------------------------------- kernels
def _sort(x_N: torch.Tensor, end_bit: int, x_out: torch.Tensor, iota_out: torch.Tensor) -> None:
    # NOTE: CUB's radix sort is stable, so equal keys keep their input order.
    values, order = torch.sort(x_N, stable=True)
    x_out.copy_(values)
    iota_out.copy_(order)


def _histogram(x: torch.Tensor, num_bins: int) -> torch.Tensor:
    rows = x.view(1, -1) if x.dim() == 1 else x
    out = torch.stack([torch.bincount(r.long(), minlength=num_bins) for r in rows]).int()
    return out.flatten() if x.dim() == 1 else out


def _inclusive_cumsum(x: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    out.copy_(torch.cumsum(x, dim))


def _exclusive_cumsum(x: torch.Tensor, dim: int, out: torch.Tensor) -> None:
    out.copy_(torch.cumsum(x, dim) - x)


def _replicate_forward(x_1B: torch.Tensor, bins_B: torch.Tensor, out_1M: torch.Tensor) -> None:
    """Column j of the output is the entry of the bin j falls in (bins are inclusive cumsums)."""
    counts_B = torch.diff(bins_B.long(), prepend=bins_B.new_zeros(1).long())
    out_1M.copy_(torch.repeat_interleave(x_1B, counts_B, dim=1))


def _gather(x_TD, indices_N, bin_ids_N, weights_N, bins_E, top_k):
    """Row i of the output is token ``indices[i] // top_k`` (scaled by ``weights[indices[i]]``)."""
    out_ND = x_TD.index_select(0, indices_N.long() // top_k)
    if weights_N is not None:
        out_ND = (out_ND.float() * weights_N.index_select(0, indices_N.long()).float().unsqueeze(1)).to(x_TD.dtype)
    return out_ND


def _scatter(x_ND, indices_N, bin_ids_N, weights_N, bins_E, top_k):
    """Row i goes to assignment ``indices[i]`` (scaled by its weight); the k assignments of a token sum."""
    rows_N = x_ND
    if weights_N is not None:
        rows_N = (x_ND.float() * weights_N.index_select(0, indices_N.long()).float().unsqueeze(1)).to(x_ND.dtype)
    out_ND = torch.empty_like(x_ND).index_copy_(0, indices_N.long(), rows_N)
    return out_ND.view(-1, top_k, x_ND.shape[1]).sum(dim=1)


def _scatter_wgrad(x_ND, grad_TD, indices_N, bin_ids_N, bins_E, top_k):
    """Gradient of each assignment's weight: <expert output row, gradient of its token>."""
    dots_N = (x_ND.float() * grad_TD.index_select(0, indices_N.long() // top_k).float()).sum(dim=1)
    return torch.empty(x_ND.shape[0], dtype=x_ND.dtype).index_copy_(0, indices_N.long(), dots_N.to(x_ND.dtype))


def _gmm(a_ND, b_EXY, batch_sizes_E, trans_b=False):
    """One matmul per expert over its contiguous rows of ``a`` (autograd through plain torch)."""
    outs = []
    for a_rows, b in zip(torch.split(a_ND, batch_sizes_E.tolist()), b_EXY, strict=False):
        outs.append(a_rows @ (b.t() if trans_b else b))
    return torch.cat(outs)


def _standins() -> dict[str, types.ModuleType]:
    ops = types.ModuleType("megablocks_ops")
    ops.sort, ops.histogram = _sort, _histogram
    ops.inclusive_cumsum, ops.exclusive_cumsum = _inclusive_cumsum, _exclusive_cumsum
    ops.replicate_forward = _replicate_forward
    kernels = types.ModuleType("megablocks.backend.kernels")
    kernels.gather, kernels.scatter, kernels.scatter_wgrad = _gather, _scatter, _scatter_wgrad
    gg = types.ModuleType("grouped_gemm")
    gg.ops = types.SimpleNamespace(gmm=_gmm)
    gg.backend = types.SimpleNamespace()
    triton_kernels = types.ModuleType("stk.backend.triton_kernels")
    return {
        "megablocks_ops": ops,
        "megablocks.backend.kernels": kernels,
        "grouped_gemm": gg,
        "stk.backend.triton_kernels": triton_kernels,
    }


@contextlib.contextmanager
def installed() -> Iterator[types.ModuleType]:
    """MegaBlocks (real sources, stand-in kernels) importable inside the block; unloaded after it."""
    roots = fetch_sources()
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        for source_root in roots:
            mp.syspath_prepend(str(source_root))
        sys.modules.update(_standins())
        # NOTE: these kernels take CPU tensors, so MegaBlocksExperts runs them there too (off the
        # kernels' device types it would run the torch backend's forward instead).
        mp.setattr(MegaBlocksExperts, "kernel_device_types", ("cuda", "cpu"))
        try:
            yield importlib.import_module("megablocks")
        finally:
            # NOTE: later tests must see the real world again, where megablocks is not installed.
            for name in set(sys.modules) - before:
                del sys.modules[name]
