import pytest
import torch
from torch import nn

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.routing_trace import RoutingTrace, routing_trace
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def seeded_model(**fields):
    torch.manual_seed(0)
    return Transformer(tiny(**fields))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"capacity_factor": 0.5},
        {"balancing": "bias", "score_func": "sigmoid"},
        {"first_dense_layers": 1, "n_layers": 3},
    ],
)
def test_trace_counts_equal_the_routers_own_buffers(fields):
    model = seeded_model(**fields).train()
    idx_BL = torch.randint(0, 97, (3, 10))
    with routing_trace(model) as recorder:
        model(idx_BL)
    trace = recorder.trace()
    layers = model.moe_layers()
    assert trace.layer_ids == model.config.moe_layer_ids and len(layers) == trace.num_layers
    assert trace.num_tokens == 30 and trace.top_k == model.config.moe.top_k
    for m, layer in enumerate(layers):
        assert torch.equal(trace.counts_ME()[m], layer.router.pending_tokens_per_expert().long())
    assert (trace.counts_ME().sum(dim=1) == 30 * trace.top_k).all()


def test_trace_records_decisions_probs_and_token_metadata():
    model = seeded_model().eval()
    first, second = torch.randint(0, 97, (2, 5)), torch.randint(0, 97, (1, 7))
    with routing_trace(model, record_probs=True) as recorder:
        recorder.set_labels(language=["en", "de"], doc="d0")
        model(first)
        recorder.set_labels(language="fr", doc="d1")
        model(second)
    trace = recorder.trace()
    assert trace.num_tokens == 17 and trace.num_sequences == 3
    assert trace.seq_N.tolist() == [0] * 5 + [1] * 5 + [2] * 7
    assert trace.pos_N.tolist() == list(range(5)) * 2 + list(range(7))
    assert trace.tokens_N.tolist() == first.reshape(-1).tolist() + second.reshape(-1).tolist()
    assert trace.labels == {"doc": ["d0", "d0", "d1"], "language": ["en", "de", "fr"]}
    # weights are the renormalised router probabilities of the chosen experts
    chosen = trace.probs_MNE.gather(-1, trace.indices_MNK)
    assert torch.allclose(trace.weights_MNK, chosen / chosen.sum(-1, keepdim=True), atol=1e-6)
    assert torch.allclose(trace.probs_MNE.sum(-1), torch.ones(2, 17))
    # the trace observes, it never changes the computation, and its hooks go away
    assert torch.equal(model(first).logits_BLV, model(first).logits_BLV)
    assert not any(layer.router._forward_hooks for layer in model.moe_layers())
    assert not model._forward_pre_hooks


def test_select_where_concat_and_transitions():
    model = seeded_model()
    with routing_trace(model) as recorder:
        recorder.set_labels(language=["en", "de"])
        model(torch.randint(0, 97, (2, 6)))
    trace = recorder.trace()
    de = trace.where(language="de")
    assert de.num_tokens == 6 and set(de.token_labels("language")) == {"de"}
    assert torch.equal(de.indices_MNK, trace.indices_MNK[:, 6:])
    both = RoutingTrace.concat([trace, de])
    # select keeps sequence ids and labels; concat shifts the second trace's ids past the first's
    assert both.num_tokens == 18 and both.labels["language"] == ["en", "de", "en", "de"]
    assert both.seq_N.tolist()[-6:] == [3] * 6 and both.token_labels("language")[-6:] == ["de"] * 6
    k = trace.top_k
    assert trace.transition_counts(0, 1, lag=0).sum() == 12 * k * k  # every token, K x K pairs
    assert trace.transition_counts(0, 0, lag=1).sum() == 2 * 5 * k * k  # consecutive pairs inside each row
    top1 = trace.indices_MNK[0, :, 0]
    manual = torch.zeros(4, 4, dtype=torch.long)
    for n in range(12):
        for e2 in trace.indices_MNK[1, n]:
            for e1 in trace.indices_MNK[0, n]:
                manual[e1, e2] += 1
    assert torch.equal(trace.transition_counts(0, 1), manual) and top1.numel() == 12
    with pytest.raises(MoeLitError, match="no label 'doc'"):
        trace.where(doc="x")


def test_save_load_round_trip(tmp_path):
    model = seeded_model()
    with routing_trace(model, record_probs=True) as recorder:
        recorder.set_labels(language="en")
        model(torch.randint(0, 97, (2, 4)))
    trace = recorder.trace()
    again = RoutingTrace.load(trace.save(tmp_path / "trace.pt"))
    for name in ("indices_MNK", "weights_MNK", "probs_MNE", "seq_N", "pos_N", "tokens_N"):
        assert torch.equal(getattr(again, name), getattr(trace, name)), name
    assert again.indices_MNK.dtype == again.seq_N.dtype == torch.long
    assert (again.layer_ids, again.num_experts, again.labels) == (trace.layer_ids, 4, {"language": ["en", "en"]})
    assert [p.name for p in tmp_path.iterdir()] == ["trace.pt"]
    with pytest.raises(MoeLitError, match="no such file"):
        RoutingTrace.load(tmp_path / "missing.pt")


def test_trace_finds_a_wrapped_transformer_and_rejects_other_modules():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = seeded_model()

    wrapper = Wrapper()
    with routing_trace(wrapper) as recorder:
        wrapper.model(torch.randint(0, 97, (1, 3)))
    assert recorder.trace().num_tokens == 3
    with pytest.raises(MoeLitError, match="holds no moe_lit Transformer"):
        with routing_trace(nn.Linear(2, 2)):
            pass
