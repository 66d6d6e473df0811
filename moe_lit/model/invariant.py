"""CPU work that gives the same bits at any intra-op thread count (``torch.set_num_threads``).

Shape legend: H hidden cells (any shape: the SwiGLU product is elementwise).

Two kinds of torch CPU kernel follow the thread count in their last bits, and the model routes around both:

* skinny fp32 GEMMs (MKL; a handful of rows): the experts run such blocks under :func:`one_thread`
  (``grouped_swiglu.SERIAL_BLOCK_ROWS``);
* transcendental elementwise ops over more than one grain of elements (``silu``, ``sigmoid``, ``exp``):
  :func:`swiglu` computes the product of both FFNs, dense and expert, forward and backward, on one thread.

NOTE: an elementwise op splits its flat range into one contiguous piece per thread (``at::parallel_for``,
grain 32768 elements); each piece runs a vectorised loop and a scalar tail, and the vectorised ``exp``
rounds differently from the scalar one. Where the pieces end follows the thread count, so ``silu`` over
the dense demo's 2**20 hidden cells differs between 1 and 3 threads (not 1 and 2, which split it at a
multiple of the vector width). On one thread there is one piece. Exact ops (``*``, ``+``, ``sqrt``)
round the same in both loops and stay threaded.

Compiled graphs (``torch.compile``) take the plain product, which inductor fuses into its own kernel;
GPU kernels do not depend on the host's threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Intra-op work on one thread inside the block, the caller's thread count restored after it."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def swiglu(h1_H: torch.Tensor, h2_H: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """``silu(h1) * h2``, the same bits at any thread count; with ``overwrite`` (no autograd) into ``h1``'s buffer.

    Bit for bit the plain torch expression at one thread, its gradients included (the same kernels in the
    same order as autograd's ``MulBackward0`` and ``SiluBackward0``).
    """
    if h1_H.device.type != "cpu" or torch.compiler.is_compiling():
        return F.silu(h1_H, inplace=True).mul_(h2_H) if overwrite else F.silu(h1_H) * h2_H
    if overwrite:
        with one_thread():
            return F.silu(h1_H, inplace=True).mul_(h2_H)
    if torch.is_grad_enabled() and (h1_H.requires_grad or h2_H.requires_grad):
        return _SerialSwiGLU.apply(h1_H, h2_H)
    with one_thread():
        return F.silu(h1_H) * h2_H


class _SerialSwiGLU(torch.autograd.Function):
    """``silu(h1) * h2`` with its forward and backward on one thread."""

    @staticmethod
    def forward(ctx: Any, h1_H: torch.Tensor, h2_H: torch.Tensor) -> torch.Tensor:
        with one_thread():
            act1_H = F.silu(h1_H)
            out_H = act1_H * h2_H
        ctx.save_for_backward(h1_H, h2_H, act1_H)
        return out_H

    @staticmethod
    def backward(ctx: Any, dout_H: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h1_H, h2_H, act1_H = ctx.saved_tensors
        needs_h1, needs_h2 = ctx.needs_input_grad
        with one_thread():
            dh1_H = torch.ops.aten.silu_backward(dout_H * h2_H, h1_H) if needs_h1 else None
            dh2_H = dout_H * act1_H if needs_h2 else None
        return dh1_H, dh2_H
