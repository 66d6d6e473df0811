"""Decode tokens/s: our KV cache vs the former full-window recompute vs transformers' ``generate``.

    .venv/bin/python -m benchmarks.generate [--new-tokens 256] [--prompt-tokens 32] [--batch 1 8]
        [--rounds 3] [--threads 2] [--sparsity 0.8] [--compile] [--preset smollm2-135m] [--models dense]
        [--dtype bfloat16] [--profile]

One process times, INTERLEAVED, greedy decoding of ``--new-tokens`` tokens after a random prompt:

* ``kv_cache``: ``moe_lit.inference.generate`` (prefill once, then one token per step);
* ``recompute``: the whole window through ``Transformer.forward`` for every new token (what the
  lm-eval adapter did before the KV cache);
* ``hf_generate``: ``LlamaForCausalLM.generate`` (its own KV cache) on a randomly initialised
  Llama built offline with ``transformers.LlamaConfig``; our dense model is that same model
  imported with ``moe_lit.convert.hf.from_hf_llama``, so both run equal weights and dims;
* with ``--compile``: ``kv_cache_compiled``, the same decode with ``generate(..., compile=True)`` on
  a copy of the model (each decode step one compiled graph, static cache; the warmup round holds the compile);
* with ``--sparsity``: ``kv_cache_sparse``, our KV-cache decode with calibrated intra-expert
  activation sparsity (calibrated on random tokens: a speed measurement, not a quality one).

``--preset smollm2-135m`` gives the dense model SmolLM2-135M's dimensions (random weights: the
speed does not depend on them). Every batch's rounds also time a read of a 1 GiB buffer (a
``sum``): the **bandwidth floor** of a decode step is the weight bytes it must read (every
parameter a token touches, the input embedding table aside, in ``--dtype``) over that read rate,
and ``floor_fraction`` is each case's tokens/s over the floor's (batch * read rate / bytes).
``--profile`` adds one ``torch.profiler`` generation of every case after the rounds, its op time
by ``benchmarks.profile_step``'s categories (ms per decoded token).

An MoE model of equal attention dims (``--experts``, ``--top-k``, expert size d_ff / top_k) runs
the moe_lit cases too (transformers has no model with our exact MoE block here). Reported:
tokens/s (batch * new tokens / seconds), paired ratios per round, and the fraction of greedy
tokens on which our KV-cache decode agrees with the recompute path and with transformers.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch

from benchmarks.common import CLOCKS, interleaved_times, median, paired_ratio, report, set_threads
from benchmarks.profile_step import categorize, profile_step_once
from moe_lit.accounting import count_model_params
from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.inference import generate
from moe_lit.inference.sparsity import SparsityConfig, sparse_model
from moe_lit.model import Transformer

PRESETS: dict[str, dict[str, object]] = {
    "smollm2-135m": dict(
        vocab=49152, d_model=576, layers=30, heads=9, kv_heads=3, d_ff=1536, tie_embeddings=True, rope_base=100000.0
    ),
}
"""Dense model dimensions of public checkpoints (HuggingFaceTB/SmolLM2-135M's config.json)."""
BANDWIDTH_PROBE_BYTES = 1 << 30


def hf_llama(cfg: ModelConfig, seed: int):
    """A random ``LlamaForCausalLM`` with ``cfg``'s dims (float32, eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_base,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    return LlamaForCausalLM(hf_cfg).float().eval()


def recompute_greedy(model: Transformer, prompt_BL: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The former decoding: every step runs the whole window."""
    idx_BL = prompt_BL
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits_BV = model(idx_BL[:, -model.config.seq_len :]).logits_BLV[:, -1]
            idx_BL = torch.cat([idx_BL, logits_BV.argmax(-1, keepdim=True)], dim=1)
    return idx_BL[:, prompt_BL.shape[1] :]


def kv_greedy(model: Transformer, prompt_BL: torch.Tensor, new_tokens: int, compile: bool = False) -> torch.Tensor:
    return torch.tensor(generate(model, prompt_BL.tolist(), new_tokens, compile=compile))


def hf_greedy(hf_model, prompt_BL: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.inference_mode():
        out = hf_model.generate(
            prompt_BL,
            attention_mask=torch.ones_like(prompt_BL),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, prompt_BL.shape[1] :]


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows' leading tokens that agree (up to the first difference, per row)."""
    same = (a == b).int().cumprod(dim=1)
    return float(same.sum()) / a.numel()


def read_bytes_per_step(model: Transformer) -> int:
    """Weight bytes one decode step reads: every parameter a token touches (the routed experts' k/E
    share), the input embedding table aside (one row per token) unless the head is that table."""
    active = count_model_params(model).active
    if model.lm_head.weight is not model.tok_embeddings.weight:
        active -= model.tok_embeddings.weight.numel()
    return active * next(model.parameters()).element_size()


def bandwidth_probe() -> tuple[Callable[[], object], int]:
    """A read of :data:`BANDWIDTH_PROBE_BYTES` (a ``sum``) and its byte count."""
    buffer = torch.ones(BANDWIDTH_PROBE_BYTES // 4)
    return buffer.sum, buffer.numel() * buffer.element_size()


def decode_profile(fn: Callable[[], object], tokens: int) -> dict[str, float]:
    """ms per token of one profiled call of ``fn`` (a generation of ``tokens`` tokens), by category."""
    by_op, wall = profile_step_once(fn)
    seconds = categorize(by_op, wall)
    return {"wall": 1e3 * wall / tokens, **{name: 1e3 * value / tokens for name, value in seconds.items()}}


def bench(
    models: dict[str, Callable[[torch.Tensor, int], torch.Tensor]],
    prompt_BL,
    new_tokens,
    rounds,
    clock,
    weight_bytes,
    profile=False,
):
    cases: dict[str, Callable[[], object]] = {
        name: (lambda fn=fn: fn(prompt_BL, new_tokens)) for name, fn in models.items()
    }
    probe, probe_bytes = bandwidth_probe()
    cases["read_1gib"] = probe
    times = interleaved_times(cases, rounds=rounds, warmup=1, clock=clock)
    read_bytes_per_s = probe_bytes / median(times.pop("read_1gib"))
    batch = prompt_BL.shape[0]
    tokens = batch * new_tokens
    floor_tokens_per_s = batch * read_bytes_per_s / weight_bytes
    outputs = {name: fn(prompt_BL, new_tokens) for name, fn in models.items()}
    result = {
        "tokens_per_s": {name: tokens / median(t) for name, t in times.items()},
        "median_s": {name: median(t) for name, t in times.items()},
        "read_gb_per_s": read_bytes_per_s / 1e9,
        "weight_bytes_per_step": weight_bytes,
        "floor_tokens_per_s": floor_tokens_per_s,
        "floor_fraction": {name: tokens / median(t) / floor_tokens_per_s for name, t in times.items()},
        "speedup_over_recompute": {
            name: paired_ratio(times, "recompute", name)
            for name in times
            if "recompute" in times and name != "recompute"
        },
        "kv_cache_agrees_with": {
            name: agreement(outputs["kv_cache"], out) for name, out in outputs.items() if name != "kv_cache"
        },
    }
    if "kv_cache_compiled" in times:
        result["compiled_speedup_over_kv_cache"] = paired_ratio(times, "kv_cache", "kv_cache_compiled")
    if "hf_generate" in times:
        result["kv_cache_over_hf_time"] = paired_ratio(times, "kv_cache", "hf_generate")
    if profile:
        result["profile_ms_per_token"] = {
            name: decode_profile(lambda fn=fn: fn(prompt_BL, new_tokens), tokens) for name, fn in models.items()
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--preset", choices=tuple(PRESETS), help="a public model's dims for the dense model")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--rope-base", type=float, default=10000.0)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=("dense", "moe"), default=["dense", "moe"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="every model's weights")
    parser.add_argument("--sparsity", type=float, help="also time KV-cache decode at this target sparsity")
    parser.add_argument("--compile", action="store_true", help="also time compiled KV-cache decode")
    parser.add_argument("--no-recompute", action="store_true", help="skip the full-window recompute case")
    parser.add_argument("--profile", action="store_true", help="also profile one generation of every case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.preset is not None:
        for key, value in PRESETS[args.preset].items():
            setattr(args, key, value)
    set_threads(args.threads)
    from moe_lit.convert.hf import from_hf_llama

    dtype = getattr(torch, args.dtype)
    seq_len = args.prompt_tokens + args.new_tokens
    dense_cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        seq_len=seq_len,
        d_ff=args.d_ff,
        tie_embeddings=args.tie_embeddings,
        rope_base=args.rope_base,
    )
    hf_model = hf_llama(dense_cfg, seed=0)
    dense = from_hf_llama(hf_model, seq_len=seq_len).to(dtype)
    hf_model.to(dtype)
    torch.manual_seed(0)
    ours: dict[str, Transformer] = {"dense": dense}
    if "moe" in args.models:
        moe_cfg = dense_cfg.replace(
            moe=MoEConfig(num_experts=args.experts, expert_size=args.d_ff // args.top_k, top_k=args.top_k)
        )
        ours["moe"] = Transformer(moe_cfg).eval().to(dtype)
    gen = torch.Generator().manual_seed(1)
    results = {}
    for batch in args.batch:
        prompt_BL = torch.randint(0, args.vocab, (batch, args.prompt_tokens), generator=gen)
        for name in args.models:
            model = ours[name]
            models = {"kv_cache": lambda p, n, m=model: kv_greedy(m, p, n)}
            if not args.no_recompute:
                models["recompute"] = lambda p, n, m=model: recompute_greedy(m, p, n)
            if args.compile:
                twin = copy.deepcopy(model)
                models["kv_cache_compiled"] = lambda p, n, m=twin: kv_greedy(m, p, n, compile=True)
            if name == "dense":
                models["hf_generate"] = lambda p, n: hf_greedy(hf_model, p, n)
            if args.sparsity is not None:
                calib = [torch.randint(0, args.vocab, (4, seq_len), generator=gen)]
                sparse = sparse_model(model, SparsityConfig(target=args.sparsity), calib)
                models["kv_cache_sparse"] = lambda p, n, m=sparse: kv_greedy(m, p, n)
            weight_bytes = read_bytes_per_step(model)
            results[f"{name}_batch{batch}"] = bench(
                models, prompt_BL, args.new_tokens, args.rounds, args.clock, weight_bytes, args.profile
            )
    setup = {key: value for key, value in vars(args).items() if key != "no_save"}
    report("generate", {"setup": setup, "results": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
