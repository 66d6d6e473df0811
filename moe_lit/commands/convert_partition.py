"""``moe-lit convert partition``: a dense checkpoint becomes an MoE by neuron partitioning.

Registered as the ``partition`` action of ``moe-lit convert``. ``--method random|kmeans|
coactivation`` split every dense FFN into E experts of d_ff/E neurons with a ``--router
centroid|trained|random``; ``--method dot_moe`` learns the split and the routers (DOT-MoE) on
``--train-tokens`` tokens of the ``--calibration`` data with the dense model as teacher;
``--method pruning`` is the structured-pruning baseline at the same active width: a dense model
that keeps each FFN's d_ff * k / E most active neurons on ``--calibration-tokens`` tokens. The output
directory holds the exported model (config.json, model.safetensors, tokenizer.json) and
``partition.json`` (what was done, with which token budget). A non-empty ``--out`` is refused
unless ``--force``, an ``--out`` that is or holds the input always.
"""

from __future__ import annotations

import argparse

from moe_lit.convert.recipes import PRUNING, partition_dense
from moe_lit.errors import MoeLitError

PARTITION_FILE = "partition.json"


def run_partition(args: argparse.Namespace) -> int:
    from moe_lit.accounting import count_model_params
    from moe_lit.checkpoint import export_model
    from moe_lit.convert.model_input import load_any_model
    from moe_lit.data.tokenizer import find_tokenizer
    from moe_lit.io import atomic_write_json
    from moe_lit.lit.datamodule import calibration_batches
    from moe_lit.lit.distill import fit_dot_moe

    _check_arguments(args)
    dense = load_any_model(args.checkpoint)
    if dense.config.is_moe:
        raise MoeLitError(f"--checkpoint: {args.checkpoint} is already an MoE; partition needs a dense model")
    batches = (
        calibration_batches(args.calibration, dense.config, args.batch_size, args.seed)
        if args.calibration is not None
        else None
    )
    options = args.options["partition_dense"].values(args)
    model, record = partition_dense(dense, args.method, args.num_experts, batches=batches, fit=fit_dot_moe, **options)
    export_model(model, args.out, find_tokenizer(args.checkpoint))
    params = count_model_params(model)
    record.update(
        method=args.method,
        num_experts=args.num_experts,
        top_k=args.top_k,
        seed=args.seed,
        checkpoint=str(args.checkpoint),
        total_params=params.total,
        active_params=params.active,
        arguments={k: v for k, v in vars(args).items() if k not in ("action", "options")},
    )
    atomic_write_json(args.out / PARTITION_FILE, record)
    shape = (
        f"dense, d_ff {dense.config.d_ff} -> {record['kept_neurons']}"
        if args.method == PRUNING
        else f"{args.num_experts} experts, top-{args.top_k}"
    )
    print(f"wrote {args.out} ({args.method}: {shape}, {params.active:,} of {params.total:,} parameters active)")
    return 0


def _check_arguments(args: argparse.Namespace) -> None:
    from moe_lit.convert.partition import NEEDS_CALIBRATION, ROUTERS

    if args.router not in (None, *ROUTERS):
        raise MoeLitError(f"--router: got {args.router!r}, allowed values: {', '.join(ROUTERS)}")
    if args.method in ("dot_moe", PRUNING) and args.router is not None:
        raise MoeLitError(f"--router: {args.method} has no router to choose; leave --router out")
    needs = (
        args.method in ("dot_moe", PRUNING)
        or args.method in NEEDS_CALIBRATION["assignment"]
        or (args.router in NEEDS_CALIBRATION["router"])
    )
    if needs and args.calibration is None:
        what = (
            f"--method {args.method}" if args.router not in NEEDS_CALIBRATION["router"] else f"--router {args.router}"
        )
        raise MoeLitError(f"--calibration: {what} needs calibration tokens (a dir written by `moe-lit data prepare`)")
    for name in ("calibration_tokens", "train_tokens", "batch_size", "router_steps"):
        if getattr(args, name) < 1:
            raise MoeLitError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")


__all__ = ["PARTITION_FILE", "partition_dense", "run_partition"]
