import pytest
import torch

from moe_lit.lit.throughput import eager_vs_compiled, training_step
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def test_a_training_step_moves_the_weights_and_lowers_the_loss_on_its_batch():
    torch.manual_seed(0)
    model = Transformer(tiny())
    batch_BL1 = torch.randint(0, model.config.vocab_size, (4, model.config.seq_len + 1))

    def loss() -> float:
        with torch.no_grad():
            return model(batch_BL1[:, :-1], batch_BL1[:, 1:]).ce.item()

    before, step = loss(), training_step(model, batch_BL1)
    for _ in range(5):
        step()
    assert loss() < before


@pytest.mark.slow
def test_eager_vs_compiled_times_copies_and_leaves_the_models_alone():
    torch.manual_seed(0)
    models = {"moe": Transformer(tiny()), "dense": Transformer(tiny(dense=True))}
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in models.items()}
    batch_BL1 = torch.randint(0, 97, (2, models["moe"].config.seq_len + 1))
    timed = eager_vs_compiled(models, batch_BL1, rounds=3, warmup=2)
    assert set(timed) == {"moe", "dense"}
    for name, row in timed.items():
        assert row["eager_tokens_per_s"] > 0 and row["compiled_tokens_per_s"] > 0 and row["compiled_speedup"] > 0
        assert row["compile_s"] >= 0  # the first steps beyond the median step: 0 when a warm cache made compiling free
        for key, value in models[name].state_dict().items():
            assert torch.equal(value, before[name][key]), key
