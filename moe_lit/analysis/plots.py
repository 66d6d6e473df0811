"""PNG plots of the routing analysis (matplotlib, headless).

Shape legend: G languages, M MoE layers, E experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def _pyplot():
    import matplotlib

    # NOTE: no display on servers and CI; the Agg backend only writes files.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def usage_heatmap(usage_GE: torch.Tensor, languages: Sequence[str], layer: int, out_file: Path) -> Path:
    """Languages x experts heatmap of one layer's expert-usage distribution."""
    plt = _pyplot()
    groups, experts = usage_GE.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * experts + 2), max(2.5, 0.4 * groups + 1.2)))
    image = ax.imshow(usage_GE.numpy(), aspect="auto", cmap="viridis", vmin=0.0)
    ax.set_xticks(range(experts), [str(e) for e in range(experts)])
    ax.set_yticks(range(groups), list(languages))
    ax.set_xlabel("expert")
    ax.set_title(f"layer {layer}: share of routed assignments")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file


def similarity_matrix(js_GG: torch.Tensor, languages: Sequence[str], order: Sequence[int], out_file: Path) -> Path:
    """Routing similarity (1 - JS) between languages, rows/columns in clustering order."""
    plt = _pyplot()
    index = torch.tensor(list(order))
    similarity_GG = 1.0 - js_GG[index][:, index]
    names = [languages[i] for i in order]
    side = max(4.5, 0.6 * len(names) + 2.5)
    fig, ax = plt.subplots(figsize=(side + 0.8, side))
    image = ax.imshow(similarity_GG.numpy(), cmap="magma", vmin=float(similarity_GG.min()), vmax=1.0)
    ax.set_xticks(range(len(names)), names, rotation=45)
    ax.set_yticks(range(len(names)), names)
    low, high = float(similarity_GG.min()), 1.0
    for i in range(len(names)):
        for j in range(len(names)):
            value = float(similarity_GG[i, j])
            # NOTE: dark text on the light end of the colour map, light text on the dark end.
            color = "black" if value > (low + high) / 2 else "white"
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=7, color=color)
    ax.set_title("routing similarity 1 - JS\n(mean over MoE layers, clustering order)", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file


__all__ = ["similarity_matrix", "usage_heatmap"]
