"""Token generation with the KV cache: greedy or sampled, batched prompts of unequal length.

Shape legend: B batch rows, L tokens of one forward step, V vocabulary.

:func:`stream` prefills every prompt once (left padded, see ``moe_lit/model/kv_cache.py``) and then feeds one
token per row and step. The context window is ``window`` tokens (default the model's
``seq_len``): longer prompts keep their last ``window`` tokens, and once the longest row fills
the window every further step recomputes each row's last ``window`` tokens from scratch, exactly
as a sliding-window recompute would. Rows end independently (a stop token, the ``stop`` predicate
or ``max_new_tokens``); the batch ends when every row has.

With ``compile=True`` each decode step's forward (:func:`decode_logits`: the embedding, every
block, the final norm and the head) runs as one compiled graph on a *static* cache
(``moe_lit/model/kv_cache.py``): one shape for every step, so one compiled decode graph per batch
size (after a second cache length, dynamo's automatic dynamic shapes make the slot dimension
symbolic: one more graph, then none); the cache's step bookkeeping (Python ints) stays outside it,
linears of one input row on CPU trace as matrix-vector loops of inductor's own (:class:`RowVectorLinear`),
the first decode step on a cache checks dynamo's guards and the later ones skip them
(``_stance``). The model is not changed. Prefills run eager (their length is the prompt's), and
so does all of a ``compile=False`` generation, even with blocks compiled earlier
(``train.compile``): its key length grows every step, which would trace a graph per step.

Dropless MoE models decode exactly as a full recompute does (up to float rounding). With token
dropping (``capacity_factor``) each step's capacity follows that step's tokens, so which
assignments are dropped differs from a full-window forward, as it already does between batches.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moe_lit.errors import MoeLitError
from moe_lit.model.compile import use_inductor_cache_dir
from moe_lit.model.kv_cache import KVCache

StopRule = Callable[[list[int]], bool]
"""Called with a row's generated tokens after each new one; True ends the row (the token is kept)."""


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Iterable[int] = (),
    stop: StopRule | None = None,
    seed: int | None = None,
    window: int | None = None,
    compile: bool = False,
) -> list[list[int]]:
    """The generated tokens of every prompt (stop tokens excluded); see :func:`stream`."""
    generated: list[list[int]] = [[] for _ in prompts]
    steps = stream(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens, stop, seed, window, compile)
    for tokens in steps:
        for row, token in enumerate(tokens):
            if token is not None:
                generated[row].append(token)
    return generated


@torch.inference_mode()
def stream(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Iterable[int] = (),
    stop: StopRule | None = None,
    seed: int | None = None,
    window: int | None = None,
    compile: bool = False,
) -> Iterator[list[int | None]]:
    """Yield, step by step, the new token of every row (None for a row that has ended).

    ``temperature`` 0 decodes greedily; otherwise tokens are sampled from the softmax of
    ``logits / temperature`` restricted to the ``top_k`` most likely and the smallest set whose
    probability reaches ``top_p``, with a ``torch.Generator`` seeded by ``seed`` (same seed, same
    tokens). A stop token ends its row and is not yielded. ``compile`` runs each decode step as one
    compiled graph (see the module docstring).
    """
    window = check_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, window)
    step_logits = compiled_decode_logits() if compile else None
    rows = [list(prompt) for prompt in prompts]
    stop_set = set(stop_tokens)
    device = next(model.parameters()).device
    generator = None if seed is None else torch.Generator(device).manual_seed(seed)
    longest = min(window, max(len(row) for row in rows))
    cache_slots = min(window, longest + max_new_tokens - 1)
    cache, logits_BV = _prefill(model, [row[-window:] for row in rows], cache_slots, device, compile)
    guarded: KVCache | None = None
    done = [False] * len(rows)
    for step in range(max_new_tokens):
        picked_B = next_tokens(logits_BV, temperature, top_k, top_p, generator).tolist()
        emitted: list[int | None] = [None] * len(rows)
        for b, token in enumerate(picked_B):
            if done[b]:
                continue
            if token in stop_set:
                done[b] = True
                continue
            rows[b].append(token)
            emitted[b] = token
            done[b] = stop is not None and stop(rows[b][len(prompts[b]) :])
        yield emitted
        if all(done) or step == max_new_tokens - 1:
            return
        if cache.length < cache.max_slots:
            idx_B1 = torch.tensor([[row[-1]] for row in rows], device=device)
            with _stance(compiled=compile, guarded=cache is guarded):
                logits_BV = _decode(model, idx_B1, cache, step_logits)
            guarded = cache
        else:
            windows = [row[-window:] for row in rows]
            cache, logits_BV = _prefill(model, windows, max(len(w) for w in windows), device, compile)


def decode_logits(model, idx_B1: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The next-token logits ``(B, V)`` of one decode step on ``cache`` (its step begun): what
    ``compile=True`` runs as one graph."""
    x_BLD, _ = model.hidden_states(idx_B1, cache)
    return model.lm_head(x_BLD[:, -1])


@functools.cache
def compiled_decode_logits() -> Callable[..., torch.Tensor]:
    """:func:`decode_logits` through ``torch.compile``, made once per process.

    NOTE: one wrapper for every generation, so that dynamo's graphs (cached on the function's code,
    guarded by the model and the shapes) serve every later generation of the same model and batch.
    """
    use_inductor_cache_dir()
    return torch.compile(_traced_decode_logits)


def _traced_decode_logits(model, idx_B1: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """:func:`decode_logits` with one-row linears as :class:`RowVectorLinear` traces them."""
    with RowVectorLinear():
        return decode_logits(model, idx_B1, cache)


class RowVectorLinear(TorchFunctionMode):
    """``F.linear`` of a single input row on CPU as a product and a sum over the input features,
    which inductor compiles into one vectorized matrix-vector loop split over the threads.

    NOTE: torch's CPU GEMM given one row reads the weights well below the rate of a plain read, and
    a batch-1 decode step is almost only such products (docs/performance.md, "One-row linears as
    inductor's own matrix-vector loops"). Only while dynamo traces: run eagerly (in a graph break
    under the mode), the product would materialise an (out, in) tensor per call.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if torch.compiler.is_compiling() and x.device.type == "cpu" and x.numel() == x.shape[-1]:
                y = (weight * x.reshape(1, -1)).sum(-1).reshape(*x.shape[:-1], weight.shape[0])
                return y if bias is None else y + bias
        return func(*args, **kwargs)


def _decode(model, idx_B1: torch.Tensor, cache: KVCache, step_logits: Callable[..., torch.Tensor] | None):
    """One decode step's next-token logits: eager through ``model``, or ``step_logits`` between the
    cache's step bookkeeping (the Python ints that would otherwise be traced into the graph)."""
    if step_logits is None:
        return model(idx_B1, kv_cache=cache).logits_BLV[:, -1]
    cache.begin(idx_B1.shape[1])
    logits_BV = step_logits(model, idx_B1, cache)
    cache.advance()
    return logits_BV


def _prefill(model, rows: list[list[int]], max_slots: int, device, static: bool) -> tuple[KVCache, torch.Tensor]:
    """A fresh cache (``static`` for compiled decoding) holding the left-padded ``rows``, and the
    next-token logits ``(B, V)``; the prefill itself runs eager."""
    length = max(len(row) for row in rows)
    pad_B = torch.tensor([length - len(row) for row in rows], device=device)
    idx_BL = torch.zeros(len(rows), length, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        idx_BL[b, length - len(row) :] = torch.tensor(row, dtype=torch.long)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.config, len(rows), max(max_slots, length), pad_B, device=device, dtype=dtype, static=static)
    # NOTE: a prefill's length is its prompt's; compiling it would trace a graph per length (or a
    # dynamic one) for a forward that runs once per generation.
    with _stance(compiled=False):
        return cache, model(idx_BL, kv_cache=cache).logits_BLV[:, -1]


def _stance(compiled: bool, guarded: bool = False) -> contextlib.AbstractContextManager:
    """Run compiled blocks as compiled (``compiled``) or eager, whether or not they are compiled.

    ``guarded``: a decode step on a cache whose first step already ran (with every guard checked,
    compiling if need be). Every later step on that cache has the same shapes, dtypes and Python
    values in the blocks' inputs (the test of compiled decoding counts no new frame over them), so
    its guards are skipped (dynamo's ``skip_guard_eval_unsafe``): their evaluation in each block is
    a fixed per-step cost of the size of a small layer's work.
    """
    if not compiled:
        return torch.compiler.set_stance("force_eager")
    if guarded:
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def next_tokens(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``(B,)`` greedy (temperature 0) or sampled next tokens."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # NOTE: drop a token when the ones before it already reach top_p; the first always stays.
        drop_BV = probs_BV.cumsum(dim=-1) - probs_BV >= top_p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


def check_arguments(model, prompts, max_new_tokens, temperature, top_k, top_p, window=None) -> int:
    """Validate the arguments of :func:`stream` (an error names the first bad one); returns the context window."""
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise MoeLitError("prompt: every prompt needs at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise MoeLitError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    if temperature < 0:
        raise MoeLitError(f"temperature: must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise MoeLitError(f"top_k: must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise MoeLitError(f"top_p: must be in (0, 1], got {top_p}")
    seq_len = model.config.seq_len
    window = seq_len if window is None else window
    if not 0 < window <= seq_len:
        raise MoeLitError(f"window: must be in 1..seq_len={seq_len}, got {window}")
    return window
