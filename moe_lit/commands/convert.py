"""``moe-lit convert ACTION``: model transforms from the command line, each writing an exported model dir.

Actions: ``import-hf`` (a transformers Llama / Mixtral / OLMoE / Qwen2-MoE / Qwen3-MoE dir, or a
GGUF file -> moe_lit, with its tokenizer where it has a real one that fits), ``upcycle`` (dense ->
MoE), ``expand`` (E -> mE experts),
``partition`` (dense -> MoE by neuron partitioning: random, k-means, co-activation, DOT-MoE) and
``prune`` (remove experts scored on calibration text; also writes ``pruning.json`` with the kept
experts, scores and memory saved) and ``moe-to-dense`` (score, select, group, scale and
concatenate experts into a dense FFN; writes ``moe_to_dense.json`` with the plan). Inputs are a
Lightning ``.ckpt`` or an exported directory; the
tokenizer found beside the input travels with the output. Every action refuses an ``--out`` that
is, holds or lies inside its input, and a non-empty one unless ``--force``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from moe_lit.accounting import count_model_params
from moe_lit.checkpoint import export_model
from moe_lit.config import BALANCING
from moe_lit.convert.dense_to_moe import RECIPES
from moe_lit.convert.model_input import load_any_model
from moe_lit.convert.partition import ASSIGNMENTS, ROUTERS
from moe_lit.data.tokenizer import find_tokenizer, model_tokenizer
from moe_lit.errors import MoeLitError
from moe_lit.io import check_output

PARTITION_METHODS = (*ASSIGNMENTS, "dot_moe", "pruning")


def _counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--counts: expected comma-separated integers, got {text!r}") from exc


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    hf = actions.add_parser("import-hf", help="import a local transformers checkpoint (dir, or dir + GGUF file)")
    hf.add_argument(
        "--model",
        required=True,
        type=Path,
        help="directory of a Llama, Mixtral, OLMoE, Qwen2-MoE or Qwen3-MoE causal LM (or of a GGUF file)",
    )
    hf.add_argument("--gguf-file", help="GGUF file name inside --model (needs `pip install gguf accelerate`)")
    hf.add_argument("--seq-len", type=int, help="RoPE table size; default: max_position_embeddings")
    hf.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype to load and keep the weights in (bfloat16 halves the memory of a big import)",
    )
    hf.add_argument("--out", required=True, type=Path, help="exported model directory to write")
    hf.add_argument("--force", action="store_true", help="replace a non-empty --out")

    up = actions.add_parser("upcycle", help="dense -> MoE (copy | granular | drop upcycling)")
    up.add_argument("--checkpoint", required=True, type=Path, help="dense model: .ckpt or exported dir")
    up.add_argument("--recipe", choices=RECIPES, default="copy", help="how the dense FFN becomes experts")
    up.add_argument("--num-experts", type=int, default=8, help="experts E of the MoE")
    up.add_argument("--top-k", type=int, default=2, help="experts routed per token")
    up.add_argument("--granularity", type=int, default=1, help="shards of d_ff per expert group (granular, drop)")
    up.add_argument("--drop-fraction", type=float, default=0.5, help="neurons re-initialised per expert (drop)")
    up.add_argument("--balancing", choices=BALANCING, default="aux_loss", help="load balancing of the MoE")
    up.add_argument("--seed", type=int, default=0, help="seed of the new routers (and drop re-init)")
    up.add_argument("--out", required=True, type=Path, help="exported model directory to write")
    up.add_argument("--force", action="store_true", help="replace a non-empty --out")

    ex = actions.add_parser("expand", help="E -> mE experts by duplication (uniform factor or per-expert counts)")
    ex.add_argument("--checkpoint", required=True, type=Path, help="MoE model: .ckpt or exported dir")
    group = ex.add_mutually_exclusive_group(required=True)
    group.add_argument("--factor", type=int, help="m: every expert gets m-1 copies")
    group.add_argument("--counts", type=_counts, help="instances per expert, e.g. 3,1,2,2")
    ex.add_argument("--noise", type=float, default=1e-3, help="U(-noise, noise) on the copies' selection bias")
    ex.add_argument("--balancing", choices=BALANCING, default="bias", help="load balancing of the expanded MoE")
    ex.add_argument("--seed", type=int, default=0, help="seed of the --noise")
    ex.add_argument("--out", required=True, type=Path, help="exported model directory to write")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out")

    pa = actions.add_parser(
        "partition",
        help="dense -> MoE by neuron partitioning (random | kmeans | coactivation | dot_moe), or the dense "
        "structured-pruning baseline at the same active width (pruning)",
    )
    pa.add_argument("--checkpoint", required=True, type=Path, help="dense model: .ckpt or exported dir")
    pa.add_argument("--method", choices=PARTITION_METHODS, required=True, help="how neurons are grouped into experts")
    pa.add_argument("--experts", "--num-experts", dest="num_experts", type=int, default=8, help="E (divides d_ff)")
    pa.add_argument("--top-k", type=int, default=2, help="experts routed per token")
    pa.add_argument(
        "--router", choices=ROUTERS, help="router of a heuristic split (default centroid); dot_moe learns its own"
    )
    pa.add_argument("--calibration", type=Path, help="prepared data dir (moe-lit data prepare): its training stream")
    pa.add_argument("--calibration-tokens", type=int, default=16_384, help="tokens for coactivation / trained router")
    pa.add_argument("--router-steps", type=int, default=100, help="full-batch Adam steps of a trained router")
    pa.add_argument(
        "--train-tokens", type=int, default=65_536, help="dot_moe: training tokens (after the calibration ones)"
    )
    pa.add_argument("--lr", type=float, default=1e-2, help="dot_moe: constant AdamW learning rate")
    pa.add_argument(
        "--train-dense", action="store_true", help="dot_moe: train every weight, not only affinities + routers"
    )
    pa.add_argument("--batch-size", type=int, default=8, help="sequences per calibration / training batch")
    pa.add_argument("--balancing", choices=BALANCING, default="aux_loss", help="load balancing of the MoE")
    pa.add_argument("--seed", type=int, default=0, help="seed of the partition and the routers")
    pa.add_argument("--out", required=True, type=Path, help="exported model directory to write")
    pa.add_argument("--force", action="store_true", help="replace a non-empty --out")
    _configure_prune(actions)
    _configure_moe_to_dense(actions)


def _configure_calibration(parser: argparse.ArgumentParser) -> None:
    """The calibration-text options shared by prune and moe-to-dense."""
    parser.add_argument(
        "--calibration",
        default="mix",
        help="mix (every language), LANG[,LANG...], or a routing trace .pt (default: mix)",
    )
    parser.add_argument("--data", type=Path, help="prepared data dir (default: the checkpoint's, else the default)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    parser.add_argument("--split", default="val", help="parallel split of the calibration text (default: val)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens per language")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward")


def _configure_moe_to_dense(actions) -> None:
    from moe_lit.convert.moe_to_dense import GROUPINGS, SCALINGS, SCORES

    md = actions.add_parser("moe-to-dense", help="MoE -> dense: score, select, group, scale and concatenate experts")
    md.add_argument("--checkpoint", required=True, type=Path, help="MoE model: .ckpt or exported dir")
    # NOTE: no argparse choices: an unknown value is the config's one-line error naming the field.
    md.add_argument("--score", default="do_acp", help=f"expert score: {' | '.join(SCORES)} (do_acp: diversity-aware)")
    md.add_argument("--keep", type=int, required=True, help="experts K kept per MoE layer")
    md.add_argument("--groups", type=int, help="groups k per layer (default: --keep, one expert per group)")
    md.add_argument("--grouping", default="single", help=f"how kept experts form groups: {' | '.join(GROUPINGS)}")
    md.add_argument("--scaling", default="gate_mass", help=f"down-projection scale of a group: {' | '.join(SCALINGS)}")
    _configure_calibration(md)
    md.add_argument("--feature-tokens", type=int, default=1024, help="tokens of the output features (do_acp, output)")
    md.add_argument("--seed", type=int, default=0, help="seed of --score random")
    md.add_argument("--force", action="store_true", help="replace a non-empty --out")
    md.add_argument("--out", required=True, type=Path, help="exported model directory to write")


def _configure_prune(actions) -> None:
    from moe_lit.convert.importance import METHODS, WEIGHTINGS

    pr = actions.add_parser("prune", help="remove experts scored on calibration text (MAESTRO, REAP, NAEE, ...)")
    pr.add_argument("--checkpoint", required=True, type=Path, help="MoE model: .ckpt or exported dir")
    pr.add_argument("--method", choices=METHODS, default="maestro", help="expert importance score")
    budget = pr.add_mutually_exclusive_group(required=True)
    budget.add_argument("--fraction", type=float, help="share of the experts removed, in [0, 1)")
    budget.add_argument("--num", type=int, help="experts removed per layer (with --global: in total)")
    pr.add_argument(
        "--global",
        dest="global_budget",
        action="store_true",
        help="one budget over all layers: layers keep different counts (never below top-k)",
    )
    _configure_calibration(pr)
    pr.add_argument("--damping", type=float, default=0.85, help="MAESTRO PageRank damping in (0, 1]; 1 = none")
    pr.add_argument("--weighting", choices=WEIGHTINGS, default="gate", help="MAESTRO edge weights")
    pr.add_argument("--naee-cap", type=int, default=2000, help="NAEE: exhaustive up to this many subsets, else greedy")
    pr.add_argument(
        "--clamp-top-k", action="store_true", help="lower top-k to the fewest kept experts instead of failing"
    )
    pr.add_argument("--seed", type=int, default=0, help="seed of --method random")
    pr.add_argument("--force", action="store_true", help="replace a non-empty --out")
    pr.add_argument("--out", required=True, type=Path, help="exported model directory to write")


def run(args: argparse.Namespace) -> int:
    flag = "--model" if args.action == "import-hf" else "--checkpoint"
    check_output(args.out, {flag: getattr(args, flag[2:])}, args.force)
    if args.action == "prune":
        return _run_prune(args)
    if args.action == "moe-to-dense":
        return _run_moe_to_dense(args)
    if args.action == "partition":
        from moe_lit.commands.convert_partition import run_partition

        return run_partition(args)
    if args.action == "import-hf":
        from moe_lit.convert.hf import from_hf
        from moe_lit.convert.hf.tokenizer import NoTokenizer, write_tokenizer_json

        model = from_hf(args.model, gguf_file=args.gguf_file, seq_len=args.seq_len, dtype=getattr(torch, args.dtype))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                tokenizer: Path | None = write_tokenizer_json(args.model, Path(tmp) / "tokenizer.json", args.gguf_file)
            except NoTokenizer as reason:
                tokenizer = None
                print(f"note: no tokenizer written: {reason}; {args.out} has none (eval needs --tokenizer)")
            export_model(model, args.out, tokenizer)
    elif args.action == "upcycle":
        from moe_lit.convert.dense_to_moe import dense_to_moe

        model = dense_to_moe(
            load_any_model(args.checkpoint),
            args.recipe,
            args.num_experts,
            args.top_k,
            args.granularity,
            args.drop_fraction,
            args.seed,
            balancing=args.balancing,
        )
        export_model(model, args.out, find_tokenizer(args.checkpoint))
    else:
        from moe_lit.convert.expand import expand_experts

        model = expand_experts(
            load_any_model(args.checkpoint),
            factor=args.factor,
            counts=args.counts,
            noise=args.noise,
            balancing=args.balancing,
            seed=args.seed,
        )
        export_model(model, args.out, find_tokenizer(args.checkpoint))
    moe = model.config.moe
    shape = f"{moe.num_experts} experts, top-{moe.top_k}" if moe else "dense"
    print(f"wrote {args.out} ({shape}, {count_model_params(model).total:,} parameters)")
    return 0


def _calibration(args: argparse.Namespace, model, record_inputs: bool):
    """The routing trace of the calibration text (or the one stored in ``--calibration FILE.pt``)."""
    from moe_lit.convert.importance import calibration_trace
    from moe_lit.evaluation.routing_trace import RoutingTrace
    from moe_lit.evaluation.tasks import resolve_data_dir

    if args.calibration.endswith(".pt"):
        return RoutingTrace.load(args.calibration), args.calibration
    languages = None if args.calibration == "mix" else [lang for lang in args.calibration.split(",") if lang]
    data_dir = resolve_data_dir(args.checkpoint, args.data)
    tokenizer = model_tokenizer(args.checkpoint, tokenizer=args.tokenizer)
    trace = calibration_trace(
        model, data_dir, tokenizer, languages, args.split, args.max_tokens, args.batch_size, record_inputs
    )
    return trace, f"{args.calibration} ({data_dir}, split {args.split}, {trace.num_tokens} tokens)"


def _run_prune(args: argparse.Namespace) -> int:
    from moe_lit.convert.importance import MaestroConfig, plan_keep
    from moe_lit.convert.prune import memory_saved, prune_experts
    from moe_lit.io import atomic_write_json

    maestro = MaestroConfig(damping=args.damping, weighting=args.weighting)
    model = load_any_model(args.checkpoint)
    if not model.config.is_moe:
        raise MoeLitError(f"--checkpoint: {args.checkpoint} is a dense model; pruning needs MoE layers")
    check_prune_budget(args, model.config)
    trace, calibration = _calibration(args, model, record_inputs=args.method in ("reap", "naee"))
    keep, details = plan_keep(
        args.method,
        model,
        trace,
        args.fraction,
        args.num,
        args.global_budget,
        args.clamp_top_k,
        args.seed,
        maestro,
        args.naee_cap,
    )
    pruned = prune_experts(model, keep, args.clamp_top_k)
    export_model(pruned, args.out, find_tokenizer(args.checkpoint))
    memory = memory_saved(model, pruned)
    report = {
        "checkpoint": str(args.checkpoint),
        "method": args.method,
        "fraction": args.fraction,
        "num": args.num,
        "global": args.global_budget,
        "calibration": calibration,
        "top_k": pruned.config.moe.top_k,
        "keep": {str(b): k for b, k in keep.items()},
        "memory": memory,
        "details": details,
    }
    atomic_write_json(args.out / "pruning.json", report)
    kept = [len(k) for k in keep.values()]
    before = sum(model.config.moe_layer_config(b).num_experts for b in keep)
    print(
        f"wrote {args.out} ({args.method}: kept {sum(kept)} of {before} experts, per layer {kept}, "
        f"top-{pruned.config.moe.top_k}; parameters {memory['params_before']:,} -> "
        f"{memory['params_after']:,} (-{memory['params_saved_fraction']:.1%}), bytes {memory['bytes_before']:,} -> "
        f"{memory['bytes_after']:,})"
    )
    if "converged" in details:
        print(
            f"maestro: damping {details['damping']}, {details['iterations']} power iterations, "
            f"residual {details['residual']:.2e} ({'converged' if details['converged'] else 'NOT converged'})"
        )
    return 0


def check_prune_budget(args: argparse.Namespace, config) -> None:
    """Refuse a budget that cannot be met (``--num``/``--fraction`` past the experts, a layer below
    top-k) before the calibration forward: the plan of equal scores meets the same checks."""
    from moe_lit.convert.prune import plan_pruning, pruned_config

    equal_scores = {block: torch.zeros(config.moe_layer_config(block).num_experts) for block in config.moe_layer_ids}
    min_keep = 1 if args.clamp_top_k else config.moe_section().top_k
    keep = plan_pruning(equal_scores, args.fraction, args.num, args.global_budget, min_keep)
    pruned_config(config, keep, args.clamp_top_k)


def _run_moe_to_dense(args: argparse.Namespace) -> int:
    from moe_lit.convert.moe_to_dense import MoeToDenseConfig, check_convertible, moe_to_dense
    from moe_lit.io import atomic_write_json

    cfg = MoeToDenseConfig(
        score=args.score,
        keep=args.keep,
        groups=args.keep if args.groups is None else args.groups,
        grouping=args.grouping,
        scaling=args.scaling,
        seed=args.seed,
        max_tokens=args.feature_tokens,
    )
    model = load_any_model(args.checkpoint)
    if not model.config.is_moe:
        raise MoeLitError(f"--checkpoint: {args.checkpoint} is a dense model; moe-to-dense needs MoE layers")
    check_convertible(model, cfg)
    trace, calibration = _calibration(args, model, record_inputs=True)
    dense, report = moe_to_dense(model, trace, cfg)
    export_model(dense, args.out, find_tokenizer(args.checkpoint))
    params = {"before": count_model_params(model).total, "after": count_model_params(dense).total}
    atomic_write_json(
        args.out / "moe_to_dense.json",
        {"checkpoint": str(args.checkpoint), "calibration": calibration, "params": params, **report},
    )
    print(
        f"wrote {args.out} ({cfg.name}: dense d_ff {report['width']}, parameters {params['before']:,} -> "
        f"{params['after']:,})"
    )
    return 0
