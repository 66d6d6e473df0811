"""Decode tokens/s: our KV cache vs the former full-window recompute vs transformers' ``generate``.

    .venv/bin/python -m benchmarks.generate [--new-tokens 256] [--prompt-tokens 32] [--batch 1 8]
        [--rounds 3] [--threads 2] [--sparsity 0.8]

One process times, INTERLEAVED, greedy decoding of ``--new-tokens`` tokens after a random prompt:

* ``kv_cache``: ``moe_lit.inference.generate`` (prefill once, then one token per step);
* ``recompute``: the whole window through ``Transformer.forward`` for every new token (what the
  lm-eval adapter did before the KV cache);
* ``hf_generate``: ``LlamaForCausalLM.generate`` (its own KV cache) on a randomly initialised
  Llama built offline with ``transformers.LlamaConfig``; our dense model is that same model
  imported with ``moe_lit.convert.hf.from_hf_llama``, so both run equal weights and dims;
* with ``--compile``: ``kv_cache_compiled``, the same decode with ``generate(..., compile=True)`` on
  a copy of the model (blocks compiled in place, static cache; the warmup round holds the compile);
* with ``--sparsity``: ``kv_cache_sparse``, our KV-cache decode with calibrated intra-expert
  activation sparsity (calibrated on random tokens: a speed measurement, not a quality one).

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
from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.inference import generate
from moe_lit.inference.sparsity import SparsityConfig, sparse_model
from moe_lit.model import Transformer


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
        tie_word_embeddings=False,
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


def bench(models: dict[str, Callable[[torch.Tensor, int], torch.Tensor]], prompt_BL, new_tokens, rounds, clock):
    cases = {name: (lambda fn=fn: fn(prompt_BL, new_tokens)) for name, fn in models.items()}
    times = interleaved_times(cases, rounds=rounds, warmup=1, clock=clock)
    tokens = prompt_BL.shape[0] * new_tokens
    outputs = {name: fn(prompt_BL, new_tokens) for name, fn in models.items()}
    result = {
        "tokens_per_s": {name: tokens / median(t) for name, t in times.items()},
        "median_s": {name: median(t) for name, t in times.items()},
        "speedup_over_recompute": {
            name: paired_ratio(times, "recompute", name) for name in times if name != "recompute"
        },
        "kv_cache_agrees_with": {
            name: agreement(outputs["kv_cache"], out) for name, out in outputs.items() if name != "kv_cache"
        },
    }
    if "kv_cache_compiled" in times:
        result["compiled_speedup_over_kv_cache"] = paired_ratio(times, "kv_cache", "kv_cache_compiled")
    if "hf_generate" in times:
        result["kv_cache_over_hf_time"] = paired_ratio(times, "kv_cache", "hf_generate")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-ff", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--sparsity", type=float, help="also time KV-cache decode at this target sparsity")
    parser.add_argument("--compile", action="store_true", help="also time compiled KV-cache decode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    from moe_lit.convert.hf import from_hf_llama

    seq_len = args.prompt_tokens + args.new_tokens
    dense_cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        seq_len=seq_len,
        d_ff=args.d_ff,
    )
    hf_model = hf_llama(dense_cfg, seed=0)
    dense = from_hf_llama(hf_model, seq_len=seq_len)
    torch.manual_seed(0)
    moe_cfg = dense_cfg.replace(
        moe=MoEConfig(num_experts=args.experts, expert_size=args.d_ff // args.top_k, top_k=args.top_k)
    )
    moe = Transformer(moe_cfg).eval()
    gen = torch.Generator().manual_seed(1)
    results = {}
    for batch in args.batch:
        prompt_BL = torch.randint(0, args.vocab, (batch, args.prompt_tokens), generator=gen)
        for name, model in (("dense", dense), ("moe", moe)):
            models = {
                "kv_cache": lambda p, n, m=model: kv_greedy(m, p, n),
                "recompute": lambda p, n, m=model: recompute_greedy(m, p, n),
            }
            if args.compile:
                twin = copy.deepcopy(model)
                models["kv_cache_compiled"] = lambda p, n, m=twin: kv_greedy(m, p, n, compile=True)
            if name == "dense":
                models["hf_generate"] = lambda p, n: hf_greedy(hf_model, p, n)
            if args.sparsity is not None:
                calib = [torch.randint(0, args.vocab, (4, seq_len), generator=gen)]
                sparse = sparse_model(model, SparsityConfig(target=args.sparsity), calib)
                models["kv_cache_sparse"] = lambda p, n, m=sparse: kv_greedy(m, p, n)
            results[f"{name}_batch{batch}"] = bench(models, prompt_BL, args.new_tokens, args.rounds, args.clock)
    setup = {key: value for key, value in vars(args).items() if key != "no_save"}
    report("generate", {"setup": setup, "results": results}, save=not args.no_save)


if __name__ == "__main__":
    main()
