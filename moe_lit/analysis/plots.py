"""Figures of the routing analysis (matplotlib, headless); the caller saves them (moe_lit.plotting.save_figure).

Shape legend: G languages, M MoE layers, E experts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from moe_lit.plotting import pyplot

USAGE_MAP = "RdBu_r"
"""Diverging colour map of the usage heatmaps: white at the uniform share, red above, blue below."""


def _share_ticks(high: float, uniform: float) -> tuple[list[float], list[str]]:
    """Colour-bar ticks at 0 and at multiples of the uniform share 1/E up to ``high`` (at most 6)."""
    step = math.ceil(high / uniform / 5)
    multiples = range(step, math.floor(high / uniform + 1e-9) + 1, step)
    if 1 not in multiples:
        multiples = [1, *multiples]
    labels = ["0", *(f"{k}/E = {k * uniform:.3g}" if k > 1 else f"1/E = {uniform:.3g}" for k in multiples)]
    return [0.0, *(k * uniform for k in multiples)], labels


def usage_figures(
    usage_GME: torch.Tensor, languages: Sequence[str], layer_ids: Sequence[int], order: Sequence[int]
) -> Iterator[tuple[int, object]]:
    """(layer id, languages x experts heatmap of that layer's usage), one layer at a time.

    Every layer is drawn on the same colour scale (0 to the largest share of any layer), so that
    a colour means the same share in every file; the scale is centred at the uniform share 1/E.
    Rows follow ``order`` (the similarity plot's clustering order).
    """
    from matplotlib.colors import TwoSlopeNorm

    plt = pyplot()
    groups, _, experts = usage_GME.shape
    uniform = 1.0 / experts
    # NOTE: a norm centred at 1/E needs a top above it; twice the uniform share keeps a layer of
    # near-uniform routing pale instead of saturated.
    high = max(float(usage_GME.max()), 2.0 * uniform)
    ticks, tick_labels = _share_ticks(high, uniform)
    index = torch.tensor(list(order))
    names = [languages[i] for i in order]
    for m, layer in enumerate(layer_ids):
        fig, ax = plt.subplots(figsize=(max(4.5, 0.45 * experts + 3), max(2.5, 0.4 * groups + 1.2)))
        norm = TwoSlopeNorm(vcenter=uniform, vmin=0.0, vmax=high)
        image = ax.imshow(usage_GME[index, m].numpy(), aspect="auto", cmap=USAGE_MAP, norm=norm)
        ax.set_xticks(range(experts), [str(e) for e in range(experts)])
        ax.set_yticks(range(groups), names)
        ax.set(xlabel="expert", ylabel="language (clustering order)")
        ax.set_title(f"layer {layer}: share of each language's routed assignments", fontsize=10)
        bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        bar.set_ticks(ticks, labels=tick_labels)
        # NOTE: on three lines: as one, the label outgrows the bar of a figure with few languages.
        bar.set_label("share\nsame scale for every layer\nwhite = uniform", fontsize=8)
        yield layer, fig


def similarity_figure(js_GG: torch.Tensor, languages: Sequence[str], order: Sequence[int]):
    """Routing similarity (1 - JS) between languages, rows/columns in clustering order."""
    plt = pyplot()
    index = torch.tensor(list(order))
    similarity_GG = 1.0 - js_GG[index][:, index]
    names = [languages[i] for i in order]
    side = max(4.5, 0.6 * len(names) + 2.5)
    fig, ax = plt.subplots(figsize=(side + 0.8, side))
    low, high = float(similarity_GG.min()), 1.0
    image = ax.imshow(similarity_GG.numpy(), cmap="magma", vmin=low, vmax=high)
    ax.set_xticks(range(len(names)), names, rotation=45)
    ax.set_yticks(range(len(names)), names)
    for i in range(len(names)):
        for j in range(len(names)):
            value = float(similarity_GG[i, j])
            # NOTE: dark text on the light end of the colour map, light text on the dark end.
            color = "black" if value > (low + high) / 2 else "white"
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=7, color=color)
    ax.set_title("routing similarity 1 - JS\n(mean over MoE layers, clustering order)", fontsize=10)
    bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    bar.set_label("1 - JS divergence (1 = same expert usage)", fontsize=8)
    return fig


__all__ = ["similarity_figure", "usage_figures"]
