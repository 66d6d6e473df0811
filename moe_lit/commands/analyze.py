"""``moe-lit analyze routing``: per-language expert routing of a checkpoint over the parallel test set.

Writes ``--out`` (default ``runs/analysis/<checkpoint name>-<path hash>``, untracked; a non-empty
one is refused unless ``--force``): ``routing.json`` (every statistic), ``summary.md`` (verdict on
language families + per-layer table), ``similarity.png`` (1 - JS, clustering order),
``usage_layer<i>.png`` (languages x experts, one colour scale for all layers, white at the
uniform share 1/E, rows in the clustering order) and, with ``--save-trace``, ``trace.pt``
(a :class:`~moe_lit.evaluation.routing_trace.RoutingTrace` for pruning / MAESTRO / conversions).

``moe-lit analyze text --checkpoint CK --text "..."`` prints the routing of one text instead: a row per
token, a column per MoE layer with its experts and combine weights (``--json``: the same as JSON).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from moe_lit.errors import MoeLitError


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    routing = sub.add_parser("routing", help="expert usage, language similarity and specialisation per layer")
    routing.add_argument("--checkpoint", required=True, type=Path, help="Lightning .ckpt or exported directory")
    routing.add_argument("--data", type=Path, help="prepared data dir (default: the checkpoint's, else the default)")
    routing.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    routing.add_argument("--split", default="test", help="parallel split to route (default: test)")
    routing.add_argument("--max-tokens", type=int, default=20_000, help="token budget per language")
    routing.add_argument("--batch-size", type=int, default=8, help="documents routed per forward")
    routing.add_argument("--device", default="auto", help="torch device; auto: CUDA when available, else CPU")
    routing.add_argument("--save-trace", action="store_true", help="also write the routing trace (trace.pt)")
    routing.add_argument("--out", type=Path, help="results directory (default: runs/analysis/<checkpoint name>-<hash>)")
    routing.add_argument("--force", action="store_true", help="replace a non-empty --out")
    _configure_text(sub)


def _configure_text(sub) -> None:
    text = sub.add_parser("text", help="each token of one text and its experts (with weights) per MoE layer")
    text.add_argument("--checkpoint", required=True, type=Path, help="Lightning .ckpt or exported directory")
    text.add_argument("--text", required=True, help="the text to route (tokenized without special tokens)")
    text.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    text.add_argument("--device", default="auto", help="torch device; auto: CUDA when available, else CPU")
    text.add_argument("--json", action="store_true", help="print the routes as JSON instead of a table")


def _run_text(args: argparse.Namespace) -> int:
    import json

    from moe_lit.analysis.text_routing import route_text, routes_table, token_routes
    from moe_lit.convert.model_input import load_any_model
    from moe_lit.data.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(args.checkpoint, tokenizer=args.tokenizer)
    model = load_any_model(args.checkpoint, map_location=args.device)
    rows = token_routes(route_text(model, tokenizer, args.text), tokenizer)
    print(json.dumps(rows, ensure_ascii=False) if args.json else routes_table(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.what == "text":
        return _run_text(args)
    from moe_lit.analysis.routing import RoutingAnalysisConfig, analyse_routing, routing_summary_markdown
    from moe_lit.evaluation.harness import default_out
    from moe_lit.io import check_output

    if not args.checkpoint.exists():
        raise MoeLitError(f"--checkpoint: no such file or directory {args.checkpoint}")
    out = args.out or default_out(args.checkpoint, "analysis")
    check_output(out, {"--checkpoint": args.checkpoint}, args.force)
    cfg = RoutingAnalysisConfig(max_tokens=args.max_tokens, batch_size=args.batch_size)
    trace, languages, data_dir = _trace(args, cfg)
    report = analyse_routing(trace, cfg, languages=languages)
    command = ["moe-lit", "analyze", "routing", "--checkpoint", str(args.checkpoint), "--data", str(data_dir)]
    if args.max_tokens != RoutingAnalysisConfig.max_tokens:
        command += ["--max-tokens", str(args.max_tokens)]
    report.update(checkpoint=str(args.checkpoint), data=str(data_dir), command=shlex.join(command))
    summary = routing_summary_markdown(report, out.name) + f"\n`{report['command']}`\n"
    _write(out, report, summary, trace if args.save_trace else None)
    print(summary)
    print(f"wrote {out}")
    return 0


def _trace(args: argparse.Namespace, cfg):
    """Route the parallel test documents of every language: ``(trace, languages, data dir)``."""
    from moe_lit.analysis.routing import tokenize_documents, trace_languages
    from moe_lit.convert.model_input import load_any_model
    from moe_lit.data.tokenizer import model_tokenizer, resolve_eot_id
    from moe_lit.evaluation.tasks import read_parallel, resolve_data_dir

    data_dir = resolve_data_dir(args.checkpoint, args.data)
    tokenizer = model_tokenizer(args.checkpoint, tokenizer=args.tokenizer)
    model = load_any_model(args.checkpoint, map_location=args.device)
    if not model.config.is_moe:
        raise MoeLitError(f"--checkpoint: {args.checkpoint} is a dense model; routing needs MoE layers")
    parallel = read_parallel(data_dir, args.split)
    token_docs = tokenize_documents(parallel, tokenizer, resolve_eot_id(tokenizer), cfg.max_tokens)
    return trace_languages(model, token_docs, cfg.batch_size), list(parallel), data_dir


def _write(out: Path, report: dict, summary: str, trace) -> Path:
    """``routing.json``, ``summary.md``, the plots and (when given) ``trace.pt``, atomically."""
    from moe_lit.io import atomic_directory, atomic_write_json

    with atomic_directory(out) as tmp:
        atomic_write_json(tmp / "routing.json", report)
        (tmp / "summary.md").write_text(summary)
        _plots(report, tmp)
        if trace is not None:
            trace.save(tmp / "trace.pt")
    return out


def _plots(report: dict, out: Path) -> None:
    import torch

    from moe_lit.analysis.plots import similarity_figure, usage_figures
    from moe_lit.plotting import save_figure

    languages = report["languages"]
    usage_GME = torch.tensor([report["usage"][lang] for lang in languages])
    order = [languages.index(lang) for lang in report["cluster_order"]]
    for layer, fig in usage_figures(usage_GME, languages, report["layer_ids"], order):
        save_figure(fig, out / f"usage_layer{layer}.png")
    save_figure(
        similarity_figure(torch.tensor(report["js_divergence"]["mean"]), languages, order), out / "similarity.png"
    )
