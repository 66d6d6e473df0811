"""``torch.compile`` of a :class:`~moe_lit.model.Transformer`, one transformer block at a time.

Each ``Block`` is compiled in place with ``nn.Module.compile`` (as torchtitan does): the module
tree, its parameters and its state-dict keys stay as they are (no ``_orig_mod.`` prefix), so a
compiled model saves and loads checkpoints exactly as an eager one. The embedding, the final norm
and the chunked head stay eager. A block is one graph: attention, norms, router, SwiGLU and
residuals are compiled, and the torch backend's routed experts enter it as custom ops
(``moe_lit/model/experts/ops.py``: opaque nodes with routing-independent output sizes, their
SwiGLU product compiled between them). MegaBlocks' experts stay eager
(``torch.compiler.disable``: its kernels are extension calls with routing-dependent sizes).

Inductor's FX graph cache (on by default) is kept under ``~/.cache/moe_lit/inductor`` unless
``TORCHINDUCTOR_CACHE_DIR`` says otherwise, so a second run with the same shapes reuses the
compiled kernels of the first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from moe_lit.model.transformer import Transformer

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_INDUCTOR_CACHE = Path("~/.cache/moe_lit/inductor")


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called on this module (``nn.Module.compile`` marks it so)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def use_inductor_cache_dir() -> str:
    """The inductor cache directory of this process: ``$TORCHINDUCTOR_CACHE_DIR``, else (set now)
    ``~/.cache/moe_lit/inductor``.

    NOTE: inductor reads the variable whenever it opens its cache, so setting it before the first
    compile is how its documented knob is turned. Importing Lightning already makes inductor write
    its own default (a temp dir, gone after a reboot) into the variable, so that value counts as
    unset; any other user setting wins.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(INDUCTOR_CACHE_ENV)
    if not current or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ[INDUCTOR_CACHE_ENV] = str(DEFAULT_INDUCTOR_CACHE.expanduser())
    return os.environ[INDUCTOR_CACHE_ENV]


def compile_blocks(model: Transformer, backend: str = "inductor") -> int:
    """Compile, in place, every transformer block of ``model`` not compiled yet with ``backend``;
    the number compiled.

    Calling it again after a model swap (upcycling) compiles only the new blocks.
    """
    use_inductor_cache_dir()
    fresh = [block for block in model.blocks if not is_compiled(block)]
    for block in fresh:
        block.compile(backend=backend)
    return len(fresh)


__all__ = ["compile_blocks", "is_compiled", "use_inductor_cache_dir"]
