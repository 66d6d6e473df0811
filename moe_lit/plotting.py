"""Matplotlib without a display, atomic figure files, and the seed spread every plot of a mean shows.

A plotted mean over seeds carries its spread: :func:`seed_errorbar` (points, ± std bars) or
:func:`seed_band` (curves, a ± std band), both from :class:`~moe_lit.stats.Summary`
objects, and :func:`spread_note` names it in the legend or title (``± std over 3 seeds``, or
``1 seed, no error bar`` when the seed noise is unknown). A plot of differences draws
:func:`zero_line`: the line of no difference and, when known, the noise band around it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_lit.stats import Summary

NOISE_COLOR = "0.85"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    # NOTE: no display on servers and CI; the Agg backend only writes files.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Write ``fig`` to ``path`` atomically (a temporary file renamed into place) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    fig.clf()
    pyplot().close(fig)
    return path


def spread_note(counts: Iterable[int], shown: str = "bars") -> str:
    """What the error bars (or bands) of means over ``counts`` seeds are, for a legend or title."""
    counts = sorted(set(counts))
    if not counts or counts[-1] < 2:
        return "1 seed, no error bar"
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    single = " (none where 1 seed)" if counts[0] < 2 else ""
    return f"{shown}: ± std over {seeds} seeds{single}"


def _errors(stats: Sequence[Summary]) -> list[float] | None:
    """± std per point, 0 where a single seed gives no spread; None when no point has one."""
    if all(s.n < 2 for s in stats):
        return None
    return [s.std if s.n > 1 else 0.0 for s in stats]


def seed_errorbar(ax, xs: Sequence[float], stats: Sequence[Summary], **kwargs):
    """Means as markers with ± std bars (no bars for single-seed points); the ErrorbarContainer."""
    kwargs.setdefault("capsize", 3)
    kwargs.setdefault("marker", "o")
    return ax.errorbar(list(xs), [s.mean for s in stats], yerr=_errors(stats), **kwargs)


def seed_band(ax, xs: Sequence[float], stats: Sequence[Summary], alpha: float = 0.2, **kwargs):
    """Mean curve with a ± std band where a point has more than one seed; the curve's Line2D."""
    means = [s.mean for s in stats]
    (line,) = ax.plot(list(xs), means, **kwargs)
    errors = _errors(stats)
    if errors is not None:
        ax.fill_between(
            list(xs),
            [m - e for m, e in zip(means, errors, strict=True)],
            [m + e for m, e in zip(means, errors, strict=True)],
            color=line.get_color(),
            alpha=alpha,
            linewidth=0,
        )
    return line


def zero_line(ax, noise: float | None = None, noise_label: str = "seed noise (± std)"):
    """The no-difference line of a difference plot and, when ``noise`` is a spread > 0, the band
    ± ``noise`` around it (a difference inside the band is as small as reseeding moves a run)."""
    ax.axhline(0.0, color="black", linewidth=0.8)
    if noise:
        ax.axhspan(-noise, noise, color=NOISE_COLOR, zorder=0, label=noise_label)


__all__ = ["pyplot", "save_figure", "seed_band", "seed_errorbar", "spread_note", "zero_line"]
