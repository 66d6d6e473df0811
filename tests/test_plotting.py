import pytest

from moe_lit.plotting import pyplot, save_figure, seed_band, seed_errorbar, spread_note, zero_line
from moe_lit.stats import summarize


@pytest.fixture
def ax():
    plt = pyplot()
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_spread_note_names_the_seeds_or_says_there_is_no_error_bar():
    assert spread_note([1, 1]) == "1 seed, no error bar"
    assert spread_note([]) == "1 seed, no error bar"
    assert spread_note([3, 3], "band") == "band: ± std over 3 seeds"
    assert spread_note([1, 3]) == "bars: ± std over 1-3 seeds (none where 1 seed)"


def test_errorbars_are_the_seed_std_and_absent_for_single_seeds(ax):
    stats = [summarize([1.0, 2.0]), summarize([3.0]), summarize([0.0, 0.5, 1.0])]
    bars = seed_errorbar(ax, [0, 1, 2], stats)
    assert bars.has_yerr
    (segments,) = bars.lines[2]
    spans = [abs(seg[1][1] - seg[0][1]) for seg in segments.get_segments()]
    assert spans == pytest.approx([2 * 0.5**0.5, 0.0, 2 * 0.5])  # ± std: twice the std long
    assert not seed_errorbar(ax, [0], [summarize([3.0])]).has_yerr


def test_band_only_with_a_spread(ax):
    seed_band(ax, [0, 1], [summarize([3.0]), summarize([2.0])])
    assert not ax.collections
    line = seed_band(ax, [0, 1], [summarize([3.0, 3.2]), summarize([2.0, 2.4])])
    assert list(line.get_ydata()) == pytest.approx([3.1, 2.2]) and len(ax.collections) == 1


def test_zero_line_with_and_without_noise(ax):
    zero_line(ax)
    assert [list(line.get_ydata()) for line in ax.lines] == [[0.0, 0.0]] and not ax.patches
    zero_line(ax, 0.02)
    (band,) = ax.patches
    assert band.get_y() == pytest.approx(-0.02) and band.get_height() == pytest.approx(0.04)


def test_save_figure_writes_a_png_and_closes_the_figure(tmp_path):
    plt = pyplot()
    fig, _ = plt.subplots()
    path = save_figure(fig, tmp_path / "sub" / "a.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and not plt.fignum_exists(fig.number)
    assert [p.name for p in path.parent.iterdir()] == ["a.png"]  # no temporary file left
