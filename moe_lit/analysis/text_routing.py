"""The routing of one text: each token's experts and combine weights in every MoE layer.

Shape legend: L tokens of the text, M MoE layers, K top-k.

``route_text`` runs the text once through the model inside
:func:`~moe_lit.evaluation.routing_trace.routing_trace` (the one trace format); ``routes_table``
prints it as one row per token and one column per MoE layer, ``e<id>:<weight>`` best first.
"""

from __future__ import annotations

import torch

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace, routing_trace


def route_text(model, tokenizer, text: str) -> RoutingTrace:
    """The routing trace of ``text`` (tokenized without special tokens, one sequence)."""
    from moe_lit.evaluation.routing_trace import find_transformer

    transformer = find_transformer(model)
    if not transformer.config.is_moe:
        raise MoeLitError("--checkpoint: a dense model has no routing")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise MoeLitError("--text: the text has no tokens")
    if len(ids) > transformer.config.seq_len:
        raise MoeLitError(f"--text: {len(ids)} tokens exceed the model's seq_len {transformer.config.seq_len}")
    device = next(transformer.parameters()).device
    with torch.no_grad(), routing_trace(transformer) as recorder:
        transformer(torch.tensor([ids], device=device))
    return recorder.trace()


def token_routes(trace: RoutingTrace, tokenizer) -> list[dict]:
    """Per token: ``{"pos", "id", "token", "layers": {layer_id: [[expert, weight], ...]}}``."""
    rows = []
    for n in range(trace.num_tokens):
        token_id = int(trace.tokens_N[n])
        layers = {
            layer: [[int(e), round(float(w), 4)] for e, w in zip(idx_K, w_K, strict=True)]
            for layer, idx_K, w_K in zip(trace.layer_ids, trace.indices_MNK[:, n], trace.weights_MNK[:, n], strict=True)
        }
        rows.append(
            {"pos": int(trace.pos_N[n]), "id": token_id, "token": tokenizer.decode([token_id]), "layers": layers}
        )
    return rows


def routes_table(rows: list[dict]) -> str:
    """Aligned text: ``pos  token  layer <i> ...``, each cell ``e<id>:<weight>`` best first."""
    if not rows:
        return ""
    layers = list(rows[0]["layers"])
    header = ["pos", "token", *(f"layer {layer}" for layer in layers)]
    body = [
        [
            str(row["pos"]),
            repr(row["token"]),
            *(" ".join(f"e{e}:{w:.2f}" for e, w in row["layers"][layer]) for layer in layers),
        ]
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *body]
    )


__all__ = ["route_text", "routes_table", "token_routes"]
