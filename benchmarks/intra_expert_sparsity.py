"""MoE layer and end-to-end decode time, dense vs intra-expert activation sparsity.

    .venv/bin/python -m benchmarks.intra_expert_sparsity [--sparsity 0.5 0.8 0.9 0.95]
        [--tokens 1 4 16 64] [--rounds 15] [--threads 2] [--rule gate]

Layer part: one MoE layer (``--experts``, ``--top-k``, expert size ``--expert-size``, d_model
``--d-model``) inside a one-block model whose thresholds are calibrated on random tokens for each
target sparsity; for each step size (tokens per forward) one process times, INTERLEAVED, the
dense forward (the forward-only expert path, no autograd) and the sparse forward at every target,
on the same normalised hidden states. Reported: median ms, the paired speedup dense / sparse per
round, and the measured inactive fraction of the neuron activations on those inputs.

End-to-end part: greedy KV-cache decoding of ``--new-tokens`` tokens (batch 1) with a
``--layers``-block MoE model, dense vs sparse at each target: tokens/s and paired speedups.
Random weights: the numbers measure speed at a given sparsity, not the accuracy it costs (the
sparsity-vs-loss measurement is ``moe_lit.inference.sparsity.sparsity_loss_curve``).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import CLOCKS, interleaved_times, median, paired_ratio, report, set_threads
from moe_lit.config import ModelConfig, MoEConfig
from moe_lit.inference import generate
from moe_lit.inference.sparsity import collect_scores, sparsify, sparsity_statistics, thresholds_at
from moe_lit.model import Transformer


def moe_model(args: argparse.Namespace, layers: int) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=layers,
        n_heads=args.heads,
        seq_len=args.seq_len,
        d_ff=args.expert_size * args.top_k,
        moe=MoEConfig(num_experts=args.experts, expert_size=args.expert_size, top_k=args.top_k),
    )
    return Transformer(cfg).eval()


def sparse_models(model: Transformer, args: argparse.Namespace, calib: list[torch.Tensor]) -> dict[float, tuple]:
    """Target -> (sparse model, thresholds), from one calibration sample."""
    sample = collect_scores(model, calib, args.rule, max_tokens=sum(c.numel() for c in calib))
    out = {}
    for target in args.sparsity:
        thresholds = thresholds_at(sample, target, "layer")
        out[target] = (sparsify(model, thresholds), thresholds)
    return out


def layer_part(args: argparse.Namespace, gen: torch.Generator) -> dict:
    model = moe_model(args, layers=1)
    calib = [torch.randint(0, args.vocab, (4, args.seq_len), generator=gen)]
    sparse = sparse_models(model, args, calib)
    results = {}
    for tokens in args.tokens:
        idx_1T = torch.randint(0, args.vocab, (1, tokens), generator=gen)
        with torch.inference_mode():
            x_1TD = model.blocks[0].ffn_norm(model.tok_embeddings(idx_1T))
        layers = {"dense": model.blocks[0].ffn, **{f"sparse_{t}": m.blocks[0].ffn for t, (m, _) in sparse.items()}}

        def case(layer, x_1TD=x_1TD):
            def run():
                with torch.inference_mode():
                    layer(x_1TD)

            return run

        times = interleaved_times({name: case(layer) for name, layer in layers.items()}, args.rounds, 3, args.clock)
        inactive = {}
        for target, (_, thresholds) in sparse.items():
            rows = sparsity_statistics(model, thresholds, {"x": [idx_1T]})
            rows = [r for r in rows if r["ffn"].endswith("experts")]
            weight = sum(r["assignments"] for r in rows)
            inactive[f"sparse_{target}"] = sum(r["inactive"] * r["assignments"] for r in rows) / weight
        results[f"tokens{tokens}"] = {
            "median_ms": {name: 1e3 * median(t) for name, t in times.items()},
            "speedup_over_dense": {name: paired_ratio(times, "dense", name) for name in times if name != "dense"},
            "inactive_fraction": inactive,
        }
    return results


def decode_part(args: argparse.Namespace, gen: torch.Generator) -> dict:
    model = moe_model(args, layers=args.layers)
    calib = [torch.randint(0, args.vocab, (4, args.seq_len), generator=gen)]
    sparse = sparse_models(model, args, calib)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_tokens), generator=gen).tolist()
    models = {"dense": model, **{f"sparse_{t}": m for t, (m, _) in sparse.items()}}
    cases = {name: (lambda m=m: generate(m, prompt, args.new_tokens)) for name, m in models.items()}
    times = interleaved_times(cases, max(1, args.rounds // 5), 1, args.clock)
    return {
        "tokens_per_s": {name: args.new_tokens / median(t) for name, t in times.items()},
        "speedup_over_dense": {name: paired_ratio(times, "dense", name) for name in times if name != "dense"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.8, 0.9, 0.95])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rule", choices=("gate", "gate_up"), default="gate")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4, help="blocks of the end-to-end decode model")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    set_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    result = {"layer": layer_part(args, gen), "decode": decode_part(args, gen)}
    setup = {key: value for key, value in vars(args).items() if key != "no_save"}
    report("intra_expert_sparsity", {"setup": setup, **result}, save=not args.no_save)


if __name__ == "__main__":
    main()
