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
from collections.abc import Iterator
from typing import Any

import torch

from moe_lit.errors import MoeLitError

PARTITION_FILE = "partition.json"
PRUNING = "pruning"
"""The structured-pruning baseline: a dense model cut to the active width d_ff * k / E (no experts)."""


def run_partition(args: argparse.Namespace) -> int:
    from moe_lit.accounting import count_model_params
    from moe_lit.checkpoint import export_model, find_tokenizer, load_model
    from moe_lit.io import atomic_write_json

    _check_arguments(args)
    dense = load_model(args.checkpoint)
    if dense.config.is_moe:
        raise MoeLitError(f"--checkpoint: {args.checkpoint} is already an MoE; partition needs a dense model")
    batches = (
        calibration_batches(args.calibration, dense.config, args.batch_size, args.seed)
        if args.calibration is not None
        else None
    )
    model, record = partition_dense(
        dense,
        args.method,
        args.num_experts,
        args.top_k,
        batches,
        router=args.router,
        calibration_tokens=args.calibration_tokens,
        router_steps=args.router_steps,
        train_tokens=args.train_tokens,
        lr=args.lr,
        train_dense=args.train_dense,
        balancing=args.balancing,
        seed=args.seed,
    )
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
        arguments={k: v for k, v in vars(args).items() if k != "action"},
    )
    atomic_write_json(args.out / PARTITION_FILE, record)
    shape = (
        f"dense, d_ff {dense.config.d_ff} -> {record['kept_neurons']}"
        if args.method == PRUNING
        else f"{args.num_experts} experts, top-{args.top_k}"
    )
    print(f"wrote {args.out} ({args.method}: {shape}, {params.active:,} of {params.total:,} parameters active)")
    return 0


def partition_dense(
    dense,
    method: str,
    num_experts: int,
    top_k: int,
    batches: Iterator[torch.Tensor] | None = None,
    *,
    router: str | None = None,
    calibration_tokens: int = 16_384,
    router_steps: int = 100,
    train_tokens: int = 65_536,
    lr: float = 1e-2,
    train_dense: bool = False,
    balancing: str = "aux_loss",
    seed: int = 0,
) -> tuple[Any, dict[str, Any]]:
    """(the MoE, what was done) for a dense model: the conversion of ``moe-lit convert partition``
    (its options, without the files), also the transform of the ``partition`` study kind.
    ``batches``: the calibration / DOT-MoE training stream (:func:`calibration_batches`)."""
    if method == "dot_moe":
        return _dot_moe(dense, num_experts, top_k, batches, train_tokens, lr, train_dense, balancing, seed)
    if method == PRUNING:
        return _pruning(dense, num_experts, top_k, batches, calibration_tokens)
    return _heuristic(
        dense,
        method,
        num_experts,
        top_k,
        batches,
        router or "centroid",
        calibration_tokens,
        router_steps,
        balancing,
        seed,
    )


def _check_arguments(args: argparse.Namespace) -> None:
    from moe_lit.convert.partition import NEEDS_CALIBRATION

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


def calibration_batches(data_dir, cfg, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """The training stream of the prepared ``data_dir``, at the model's sequence length."""
    from moe_lit.lit.datamodule import MoEDataModule

    datamodule = MoEDataModule(str(data_dir), seq_len=cfg.seq_len, batch_size=batch_size, seed=seed)
    if datamodule.vocab_size != cfg.vocab_size:
        raise MoeLitError(
            f"--calibration: its tokenizer has {datamodule.vocab_size} tokens, the model {cfg.vocab_size}; "
            "prepare the data with the model's tokenizer"
        )
    return iter(datamodule.train_dataloader())


def _take(batches: Iterator[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """Whole batches from ``batches`` until ``tokens`` predicted tokens are covered."""
    out, seen = [], 0
    for batch_BL1 in batches:
        out.append(batch_BL1)
        seen += batch_BL1[:, 1:].numel()
        if seen >= tokens:
            return out
    raise MoeLitError(f"--calibration: the training stream has only {seen} tokens, fewer than the {tokens} asked")


def _heuristic(dense, method, num_experts, top_k, batches, router, calibration_tokens, router_steps, balancing, seed):
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.partition import assign_neurons, build_routers, partition_ffn, partitioned_config

    cfg = partitioned_config(dense.config, num_experts, top_k, balancing=balancing)
    calibration, tokens = None, 0
    if batches is not None and (method == "coactivation" or router == "trained"):
        taken = _take(batches, calibration_tokens)
        tokens = sum(b[:, 1:].numel() for b in taken)
        calibration = ffn_inputs(dense, taken, calibration_tokens)
    assignment = assign_neurons(dense, method, num_experts, calibration, seed, cfg.moe_layer_ids)
    routers = build_routers(dense, assignment, router, num_experts, calibration, seed, router_steps)
    model = partition_ffn(dense, assignment, num_experts, top_k, routers, seed, balancing=balancing)
    return model, {"router": router, "calibration_tokens": tokens, "train_tokens": 0}


def _pruning(dense, num_experts, top_k, batches, calibration_tokens):
    from moe_lit.convert.calibration import ffn_inputs
    from moe_lit.convert.prune_dense import prune_dense_ffn

    if num_experts < 1 or top_k < 1 or (dense.config.d_ff * top_k) % num_experts:
        raise MoeLitError(
            f"--top-k/--experts: pruning keeps d_ff * k / E neurons, which must be a whole number; "
            f"got d_ff={dense.config.d_ff}, k={top_k}, E={num_experts}"
        )
    keep = dense.config.d_ff * top_k // num_experts
    calibration = ffn_inputs(dense, batches, calibration_tokens)
    tokens = min(len(x_TD) for x_TD in calibration.values())
    return prune_dense_ffn(dense, calibration, keep), {
        "router": None,
        "calibration_tokens": tokens,
        "train_tokens": 0,
        "kept_neurons": keep,
    }


def _dot_moe(dense, num_experts, top_k, batches, train_tokens, lr, train_dense, balancing, seed):
    from moe_lit.convert.dot_moe import DotMoEConfig, dot_moe_student, export_dot_moe, fit_dot_moe
    from moe_lit.lit.optim import OptimConfig

    if batches is None:
        raise MoeLitError("calibration: method dot_moe needs training batches (calibration_batches of a prepared dir)")
    cfg = DotMoEConfig(train_dense=train_dense)
    student = dot_moe_student(dense, num_experts, top_k, cfg, seed, balancing=balancing)
    taken = _take(batches, train_tokens)
    optim = OptimConfig(lr=lr, warmup_steps=0, schedule="constant")
    fit_dot_moe(dense, student, taken, cfg, optim)
    tokens = sum(b[:, 1:].numel() for b in taken)
    record = {
        "router": "learned",
        "calibration_tokens": 0,
        "train_tokens": tokens,
        "steps": len(taken),
        "train_dense": train_dense,
        "lr": lr,
    }
    return export_dot_moe(student), record


__all__ = ["PARTITION_FILE", "PRUNING", "calibration_batches", "partition_dense", "run_partition"]
