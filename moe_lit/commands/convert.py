"""``moe-lit convert ACTION``: model transforms from the command line, each writing an exported model dir.

Actions: ``import-hf`` (a transformers dir of a registered family, ``moe_lit.convert.hf.FAMILIES``, or a
GGUF file -> moe_lit, with its tokenizer where it has a real one that fits), ``upcycle`` (dense ->
MoE), ``expand`` (E -> mE experts),
``partition`` (dense -> MoE by neuron partitioning: random, k-means, co-activation, DOT-MoE) and
``prune`` (remove experts scored on calibration text; also writes ``pruning.json`` with the kept
experts, scores and memory saved) and ``moe-to-dense`` (score, select, group, scale and
concatenate experts into a dense FFN; writes ``moe_to_dense.json`` with the plan). Inputs are a
Lightning ``.ckpt`` or an exported directory; the
tokenizer found beside the input travels with the output. Every action refuses an ``--out`` that
is, holds or lies inside its input, and a non-empty one unless ``--force``.

A transform's options are its config's fields (``UpcyclingConfig``, ``ExpansionConfig``,
``MoeToDenseConfig``, ``MaestroConfig``) or its function's parameters, derived by
:func:`moe_lit.commands.options.add_options`: a new field is a new option, its docstring the help.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from moe_lit.accounting import count_model_params
from moe_lit.checkpoint import export_model
from moe_lit.commands.options import add_options, field_help
from moe_lit.config import MoEConfig
from moe_lit.convert.model_input import load_any_model
from moe_lit.convert.partition import ASSIGNMENTS, ROUTERS
from moe_lit.data.tokenizer import find_tokenizer, model_tokenizer
from moe_lit.errors import MoeLitError
from moe_lit.io import check_output

PARTITION_METHODS = (*ASSIGNMENTS, "dot_moe", "pruning")
PARTITION_HELP = {
    "num_experts": "E (divides d_ff)",
    "top_k": "experts routed per token",
    "router": f"router of a heuristic split: {' | '.join(ROUTERS)} (default centroid); dot_moe learns its own",
    "calibration_tokens": "tokens for coactivation / trained router",
    "router_steps": "full-batch Adam steps of a trained router",
    "train_tokens": "dot_moe: training tokens (after the calibration ones)",
    "lr": "dot_moe: constant AdamW learning rate",
    "train_dense": "dot_moe: train every weight, not only affinities + routers",
    "balancing": "load balancing of the MoE",
    "seed": "seed of the partition and the routers",
}
"""Help of :func:`moe_lit.convert.recipes.partition_dense`'s parameters (its docstring has no ``Args:``)."""
PRUNE_HELP = {
    "fraction": "share of the experts removed, in [0, 1)",
    "num": "experts removed per layer (with --global: in total)",
    "global_budget": "one budget over all layers: layers keep different counts (never below top-k)",
    "clamp_top_k": "lower top-k to the fewest kept experts instead of failing",
    "seed": "seed of --method random",
    "naee_cap": "NAEE: exhaustive up to this many subsets, else greedy",
}
"""Help of :func:`moe_lit.convert.importance.plan_keep`'s parameters (its docstring has no ``Args:``)."""


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _configure_import_hf(actions)
    _configure_upcycle(actions)
    _configure_expand(actions)
    _configure_partition(actions)
    _configure_prune(actions)
    _configure_moe_to_dense(actions)


def _checkpoint(parser: argparse.ArgumentParser, what: str) -> None:
    """``--checkpoint``, the input model of every action but import-hf."""
    parser.add_argument("--checkpoint", required=True, type=Path, help=f"{what}: .ckpt or exported dir")


def _output(parser: argparse.ArgumentParser) -> None:
    """``--out`` and ``--force``, the last options of every action."""
    parser.add_argument("--out", required=True, type=Path, help="exported model directory to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")


def _configure_import_hf(actions) -> None:
    from moe_lit.convert.hf.families import FAMILIES, from_hf

    hf = actions.add_parser("import-hf", help="import a local transformers checkpoint (dir, or dir + GGUF file)")
    families = ", ".join(FAMILIES.names())
    hf.add_argument(
        "--model", required=True, type=Path, help=f"directory of a causal LM ({families}) or of a GGUF file"
    )
    options = add_options(hf, from_hf, only=("gguf_file", "seq_len"))
    hf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help=field_help(from_hf, "dtype"))
    _output(hf)
    hf.set_defaults(options={"from_hf": options})


def _configure_upcycle(actions) -> None:
    from moe_lit.convert.dense_to_moe import UpcyclingConfig

    up = actions.add_parser("upcycle", help="dense -> MoE (copy | granular | drop upcycling)")
    _checkpoint(up, "dense model")
    upcycling = add_options(up, UpcyclingConfig, skip=("moe",))
    moe = add_options(up, MoEConfig, only=("balancing",))
    _output(up)
    up.set_defaults(options={"upcycling": upcycling, "moe": moe})


def _configure_expand(actions) -> None:
    from moe_lit.convert.expand import ExpansionConfig

    ex = actions.add_parser("expand", help="E -> mE experts by duplication (uniform factor or per-expert counts)")
    _checkpoint(ex, "MoE model")
    # NOTE: utility selection needs training gradients, which a command has none of (ExpertUpcycling has).
    utility = ("selection", "utility_metric", "max_copies")
    expansion = add_options(ex, ExpansionConfig, skip=utility, one_of=("factor", "counts"))
    _output(ex)
    ex.set_defaults(options={"expansion": expansion})


def _configure_partition(actions) -> None:
    from moe_lit.convert.recipes import partition_dense

    pa = actions.add_parser(
        "partition",
        help="dense -> MoE by neuron partitioning (random | kmeans | coactivation | dot_moe), or the dense "
        "structured-pruning baseline at the same active width (pruning)",
    )
    _checkpoint(pa, "dense model")
    pa.add_argument("--method", choices=PARTITION_METHODS, required=True, help="how neurons are grouped into experts")
    pa.add_argument("--experts", "--num-experts", dest="num_experts", type=int, default=8, help="E (divides d_ff)")
    pa.add_argument("--calibration", type=Path, help="prepared data dir (moe-lit data prepare): its training stream")
    pa.add_argument("--batch-size", type=int, default=8, help="sequences per calibration / training batch")
    keywords = [n for n in PARTITION_HELP if n != "num_experts"]
    options = add_options(pa, partition_dense, keywords, defaults={"top_k": 2}, helps=PARTITION_HELP)
    _output(pa)
    pa.set_defaults(options={"partition_dense": options})


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
    from moe_lit.convert.moe_to_dense import MoeToDenseConfig

    md = actions.add_parser("moe-to-dense", help="MoE -> dense: score, select, group, scale and concatenate experts")
    _checkpoint(md, "MoE model")
    config = add_options(
        md,
        MoeToDenseConfig,
        rename={"max_tokens": "feature_tokens"},
        required=("keep",),
        defaults={"groups": None},
        helps={"groups": "groups G per layer (default: --keep, one expert per group)"},
    )
    _configure_calibration(md)
    _output(md)
    md.set_defaults(options={"moe_to_dense": config})


def _configure_prune(actions) -> None:
    from moe_lit.convert.importance import METHODS, MaestroConfig, plan_keep

    pr = actions.add_parser("prune", help="remove experts scored on calibration text (MAESTRO, REAP, NAEE, ...)")
    _checkpoint(pr, "MoE model")
    pr.add_argument("--method", choices=METHODS, default="maestro", help="expert importance score")
    budget = add_options(
        pr,
        plan_keep,
        list(PRUNE_HELP),
        rename={"global_budget": "global"},
        helps=PRUNE_HELP,
        one_of=("fraction", "num"),
    )
    _configure_calibration(pr)
    maestro = add_options(pr, MaestroConfig, prefix="MAESTRO: ")
    _output(pr)
    pr.set_defaults(options={"plan_keep": budget, "maestro": maestro})


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

        model = from_hf(args.model, **args.options["from_hf"].values(args), dtype=getattr(torch, args.dtype))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                tokenizer: Path | None = write_tokenizer_json(args.model, Path(tmp) / "tokenizer.json", args.gguf_file)
            except NoTokenizer as reason:
                tokenizer = None
                print(f"note: no tokenizer written: {reason}; {args.out} has none (eval needs --tokenizer)")
            export_model(model, args.out, tokenizer)
    elif args.action == "upcycle":
        from moe_lit.convert.dense_to_moe import UpcyclingConfig, upcycle

        config = UpcyclingConfig(**args.options["upcycling"].values(args), moe=args.options["moe"].values(args))
        model = upcycle(load_any_model(args.checkpoint), config)
        export_model(model, args.out, find_tokenizer(args.checkpoint))
    else:
        from moe_lit.convert.expand import ExpansionConfig, grow

        model = grow(load_any_model(args.checkpoint), ExpansionConfig(**args.options["expansion"].values(args)))
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

    maestro = MaestroConfig(**args.options["maestro"].values(args))
    model = load_any_model(args.checkpoint)
    if not model.config.is_moe:
        raise MoeLitError(f"--checkpoint: {args.checkpoint} is a dense model; pruning needs MoE layers")
    budget = args.options["plan_keep"].values(args)
    check_prune_budget(budget, model.config)
    trace, calibration = _calibration(args, model, record_inputs=args.method in ("reap", "naee"))
    keep, details = plan_keep(args.method, model, trace, maestro=maestro, **budget)
    pruned = prune_experts(model, keep, budget["clamp_top_k"])
    export_model(pruned, args.out, find_tokenizer(args.checkpoint))
    memory = memory_saved(model, pruned)
    report = {
        "checkpoint": str(args.checkpoint),
        "method": args.method,
        "fraction": budget["fraction"],
        "num": budget["num"],
        "global": budget["global_budget"],
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


def check_prune_budget(budget: dict, config) -> None:
    """Refuse a ``budget`` (:func:`~moe_lit.convert.importance.plan_keep`'s keywords) that cannot be
    met (``--num``/``--fraction`` past the experts, a layer below top-k) before the calibration
    forward: the plan of equal scores meets the same checks."""
    from moe_lit.convert.prune import plan_pruning, pruned_config

    equal_scores = {block: torch.zeros(config.moe_layer_config(block).num_experts) for block in config.moe_layer_ids}
    min_keep = 1 if budget["clamp_top_k"] else config.moe_section().top_k
    keep = plan_pruning(equal_scores, budget["fraction"], budget["num"], budget["global_budget"], min_keep)
    pruned_config(config, keep, budget["clamp_top_k"])


def _run_moe_to_dense(args: argparse.Namespace) -> int:
    from moe_lit.convert.moe_to_dense import MoeToDenseConfig, check_convertible, moe_to_dense
    from moe_lit.io import atomic_write_json

    fields = args.options["moe_to_dense"].values(args)
    cfg = MoeToDenseConfig(**{**fields, "groups": args.keep if args.groups is None else args.groups})
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
