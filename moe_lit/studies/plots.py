"""Figures the study kinds share: a mean per category ± its seed std, side by side per series.

Every kind compares arms or methods as categories on the x axis: :func:`categories` draws one
error bar per category for each series (a fraction, a grouping, before / after), offset so that
they do not overprint, names the ticks and the spread (:func:`moe_lit.plotting.spread_note`), and
draws the reference line it is given (the zero of a difference, the 1 of a retention);
:func:`differences` draws paired differences to a reference around zero with its noise band,
:func:`lines` series over a numeric axis, :func:`per_step` summarises curves over seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from moe_lit.plotting import pyplot, save_figure, seed_errorbar, spread_note, zero_line
from moe_lit.stats import Summary, summarize


def categories(
    ax,
    names: Sequence[str],
    series: Mapping[str | None, Sequence[Summary]],
    ylabel: str = "",
    title: str = "",
    zero: bool = False,
    reference: tuple[float, str] | None = None,
    rotation: int = 0,
    **style,
) -> list[int]:
    """Each series' summaries (one per name) as error bars at the names' ticks; ``zero``: a zero
    line (a difference), ``reference``: (y, label) of a reference line. Returns the n of every
    summary drawn (for :func:`~moe_lit.plotting.spread_note`); the title gets the spread note."""
    counts: list[int] = []
    width = 0.6 / max(1, len(series))
    for i, (label, stats) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(names))]
        seed_errorbar(ax, xs, list(stats), linestyle="none", label=label, **style)
        counts += [s.n for s in stats if s.n]
    if zero:
        zero_line(ax)
    if reference is not None:
        ax.axhline(reference[0], color="grey", linewidth=0.8, label=reference[1])
    ax.set_xticks(range(len(names)), list(names), rotation=rotation, ha="right" if rotation else "center", fontsize=8)
    ax.set_xlim(-0.6, max(1, len(names)) - 0.4)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.set_title(f"{title} ({spread_note(counts)})" if title else spread_note(counts), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    if any(label is not None for label in series) or reference is not None:
        ax.legend(fontsize=7)
    return counts


def differences(ax, labels: Sequence[str], stats: Sequence[Summary], noise: float | None = None, scale=None) -> None:
    """Paired differences to a reference (one summary per label) around the zero line, with the
    reference's seed std as the grey noise band when known, ``scale`` ((y, label): the study's main
    effect, a scale where one seed gives no band) as a dashed line, and every mean written beside it."""
    seed_errorbar(ax, range(len(stats)), list(stats), linestyle="none", color="tab:blue")
    zero_line(ax, noise, "seed std of the reference")
    if scale is not None:
        ax.axhline(scale[0], color="tab:green", linestyle="--", linewidth=1, label=scale[1])
    for i, s in enumerate(stats):
        ax.annotate(f"{s.mean:+.4f}", (i, s.mean), textcoords="offset points", xytext=(6, 0), fontsize=7, va="center")
    ax.set_xticks(range(len(labels)), list(labels), fontsize=7)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    if noise or scale is not None:
        ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def lines(
    ax, series: Mapping[str, tuple[Sequence[float], Sequence[Summary]]], xlabel: str, ylabel: str, title: str, **style
):
    """Each series (label -> (xs, summaries)) as a line of means ± seed std, with the axis labels,
    the title and the spread note under it, a grid and the legend."""
    counts: list[int] = []
    for label, (xs, stats) in series.items():
        seed_errorbar(ax, list(xs), list(stats), label=label, **style)
        counts += [s.n for s in stats]
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{title}\n({spread_note(counts)})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def per_step(curves: Mapping[int, Mapping[int, float]], since: int = 0) -> tuple[list[int], list[Summary]]:
    """Curves of several seeds (seed -> step -> value): the steps >= ``since`` every seed measured,
    and the values over the seeds at each."""
    steps = sorted(s for s in set.intersection(*(set(c) for c in curves.values())) if s >= since)
    return steps, [summarize([c[s] for c in curves.values()]) for s in steps]


def category_figure(
    plots_dir: Path, name: str, panels_kwargs: Sequence[Mapping], width: float = 5.0, height: float = 4.0, **figure
):
    """``plots_dir/<name>.png``: one :func:`categories` panel per entry of ``panels_kwargs`` (its
    keyword arguments, ``series`` as seed -> value maps, summarized here), side by side;
    ``figure``: ``sharey``, ``ylabel`` (of the first panel, set after), ``suptitle`` (given the
    spread note of every panel)."""
    fig, axes = panels(len(panels_kwargs), width, height, sharey=figure.get("sharey", False))
    counts: list[int] = []
    for ax, kwargs in zip(axes, panels_kwargs, strict=True):
        series = {label: [summarize(list(by.values())) for by in maps] for label, maps in kwargs["series"].items()}
        counts += categories(ax, **{**kwargs, "series": series})
    if figure.get("ylabel"):
        axes[0].set_ylabel(figure["ylabel"])
    if figure.get("suptitle"):
        fig.suptitle(f"{figure['suptitle']} ({spread_note(counts)})", fontsize=10)
    return save(fig, plots_dir, name)


def panels(count: int, width: float = 5.0, height: float = 4.0, sharey: bool = False):
    """(figure, list of ``count`` axes side by side)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, count, figsize=(max(6.0, width * count), height), sharey=sharey, squeeze=False)
    return fig, list(axes[0])


def save(fig, plots_dir: Path, name: str) -> Path:
    """``plots_dir/<name>.png``, written atomically; the figure is closed."""
    return save_figure(fig, Path(plots_dir) / f"{name}.png")


__all__ = ["categories", "category_figure", "differences", "lines", "panels", "per_step", "save"]
