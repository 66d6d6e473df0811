"""``moe-lit generate``: continue prompts with a checkpoint (KV cache; greedy or sampled).

The checkpoint is a Lightning ``.ckpt`` or an exported directory; its stored tokenizer is used
unless ``--tokenizer`` is given. Each row stops at the end-of-text token or after
``--max-new-tokens``. ``--stream`` prints the tokens of one prompt as they come; ``--compile``
decodes each step as one compiled graph (``moe_lit.inference.generate``). ``--sparsity``
runs the model with calibrated intra-expert activation sparsity (``moe_lit.inference.sparsity``).
``--precision`` (default auto: bf16 weights only where the CPU computes bf16 natively and a probe
measures it faster, ``moe_lit.inference.precision``) is said in one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_lit.errors import MoeLitError


def add_sparsity_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--sparsity`` options shared by the commands that run a model."""
    from moe_lit.inference.sparsity import GRANULARITIES, RULES

    group = parser.add_argument_group("intra-expert activation sparsity")
    group.add_argument("--sparsity", type=float, help="target fraction of expert neurons to skip, in [0, 1)")
    group.add_argument("--sparsity-rule", choices=RULES, default="gate", help="neuron score (default gate)")
    group.add_argument(
        "--sparsity-granularity", choices=GRANULARITIES, default="layer", help="one threshold per layer or per expert"
    )
    group.add_argument("--calibration", type=Path, help="text file the thresholds are calibrated on")


def sparse_from_args(model, tokenizer, args: argparse.Namespace):
    """``model`` sparsified as ``--sparsity`` asks (itself without it)."""
    from moe_lit.inference.sparsity import SparsityConfig, sparse_model, text_calibration

    if args.sparsity is None:
        return model
    cfg = SparsityConfig(target=args.sparsity, rule=args.sparsity_rule, granularity=args.sparsity_granularity)
    if args.calibration is None:
        raise MoeLitError("--calibration: a text file is needed with --sparsity")
    batches = text_calibration(tokenizer, args.calibration, model.config.seq_len, cfg.calibration_tokens)
    return sparse_model(model, cfg, batches)


def add_precision_argument(parser: argparse.ArgumentParser) -> None:
    """The ``--precision`` option shared by the commands that run a model."""
    from moe_lit.inference.precision import INFERENCE_PRECISIONS

    parser.add_argument(
        "--precision",
        choices=INFERENCE_PRECISIONS,
        default="auto",
        help="32-true (fp32 weights) | bf16-true (bf16 weights and KV cache) | auto (default): bf16-true for a "
        "dense model where the CPU has native bf16 and a probe measures it faster, else fp32",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help="Lightning .ckpt or exported directory")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    parser.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability >= p")
    parser.add_argument("--seed", type=int, help="sampling seed (same seed, same text)")
    parser.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the one stored with the checkpoint)")
    parser.add_argument("--device", default="auto", help="torch device; auto: CUDA when available, else CPU")
    parser.add_argument(
        "--compile", action="store_true", help="decode each step as one torch.compile'd graph (pays the compile once)"
    )
    add_precision_argument(parser)
    add_sparsity_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from moe_lit.convert.model_input import load_any_model
    from moe_lit.data.tokenizer import model_tokenizer
    from moe_lit.inference import generate, stream
    from moe_lit.inference.generate import check_arguments
    from moe_lit.inference.precision import to_precision

    if args.stream and len(args.prompt) != 1:
        raise MoeLitError(f"--stream: prints one prompt as it grows; got {len(args.prompt)} --prompt")
    tokenizer = model_tokenizer(args.checkpoint, tokenizer=args.tokenizer)
    model = sparse_from_args(load_any_model(args.checkpoint, map_location=args.device), tokenizer, args)
    prompts = [tokenizer.encode(text, add_special_tokens=False).ids for text in args.prompt]
    check_arguments(model, prompts, args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    model, _ = to_precision(model, args.precision, str(next(model.parameters()).device))
    options = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "stop_tokens": _stop_tokens(tokenizer),
        "seed": args.seed,
        "compile": args.compile,
    }
    if args.stream:
        _print_stream(tokenizer, args.prompt[0], stream(model, prompts, **options))
        return 0
    for text, tokens in zip(args.prompt, generate(model, prompts, **options), strict=False):
        print(text + tokenizer.decode(tokens))
    return 0


def _stop_tokens(tokenizer) -> list[int]:
    from moe_lit.data.tokenizer import resolve_eot_id

    try:
        return [resolve_eot_id(tokenizer)]
    except MoeLitError:
        return []


def _print_stream(tokenizer, prompt: str, steps) -> None:
    """Print the prompt, then each new piece of decoded text (held back while a UTF-8 character is split)."""
    out = sys.stdout
    out.write(prompt)
    out.flush()
    tokens: list[int] = []
    shown = 0
    for step in steps:
        if step[0] is None:
            continue
        tokens.append(step[0])
        text = tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    out.write("\n")
