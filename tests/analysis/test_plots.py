import pytest
import torch

from moe_lit.analysis.plots import similarity_figure, usage_figures
from moe_lit.plotting import pyplot


def test_usage_heatmaps_share_one_scale_centred_at_the_uniform_share_with_rows_in_the_given_order():
    # layer 0 routes almost uniformly, layer 1 sends 90% of "b" to one expert
    usage_GME = torch.tensor(
        [
            [[0.25, 0.25, 0.25, 0.25], [0.4, 0.2, 0.2, 0.2]],
            [[0.3, 0.2, 0.25, 0.25], [0.9, 0.05, 0.05, 0.0]],
            [[0.2, 0.3, 0.25, 0.25], [0.1, 0.3, 0.3, 0.3]],
        ]
    )
    figures = dict(usage_figures(usage_GME, ["a", "b", "c"], [3, 5], order=[2, 0, 1]))
    assert list(figures) == [3, 5]
    for m, fig in enumerate(figures.values()):
        ax, bar_ax = fig.axes
        (image,) = ax.get_images()
        norm = image.norm
        assert (norm.vmin, norm.vcenter, norm.vmax) == pytest.approx((0.0, 0.25, 0.9))  # the same in every layer
        assert torch.equal(torch.as_tensor(image.get_array()), usage_GME[[2, 0, 1], m])
        assert [t.get_text() for t in ax.get_yticklabels()] == ["c", "a", "b"]
        assert "1/E = 0.25" in [t.get_text() for t in bar_ax.get_yticklabels()]
        assert "same scale for every layer" in bar_ax.get_ylabel()
        pyplot().close(fig)


def test_near_uniform_routing_stays_pale():
    usage_GME = torch.full((2, 1, 4), 0.25)
    ((_, fig),) = usage_figures(usage_GME, ["a", "b"], [0], order=[0, 1])
    (image,) = fig.axes[0].get_images()
    assert image.norm.vmax == pytest.approx(0.5)  # a norm centred at 1/E needs a top above it
    pyplot().close(fig)


def test_similarity_figure_orders_rows_and_labels_its_colour_bar():
    js_GG = torch.tensor([[0.0, 0.2, 0.5], [0.2, 0.0, 0.4], [0.5, 0.4, 0.0]])
    fig = similarity_figure(js_GG, ["a", "b", "c"], order=[2, 1, 0])
    ax, bar_ax = fig.axes
    assert ax.get_images()[0].get_array()[0].tolist() == pytest.approx([1.0, 0.6, 0.5])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["c", "b", "a"] and "1 - JS" in bar_ax.get_ylabel()
    pyplot().close(fig)


@pytest.mark.parametrize("languages", [1, 2, 9])
def test_the_colour_bar_label_fits_in_the_figure(languages):
    usage_GME = torch.full((languages, 1, 4), 0.25)
    ((_, fig),) = usage_figures(usage_GME, [f"l{i}" for i in range(languages)], [0], order=list(range(languages)))
    fig.tight_layout()
    fig.canvas.draw()
    label = fig.axes[1].yaxis.label.get_window_extent()
    assert fig.bbox.y0 <= label.y0 and label.y1 <= fig.bbox.y1 and label.x1 <= fig.bbox.x1
    pyplot().close(fig)
