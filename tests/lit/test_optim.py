import math

import pytest
import torch

from moe_lit.config import ConfigError
from moe_lit.lit.optim import OptimConfig, build_optimizer, lr_multiplier, param_groups
from moe_lit.model import Transformer
from tests.helpers.models import tiny


def _names(model, params):
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_param_groups_exclude_norms_biases_and_embedding_from_decay():
    model = Transformer(tiny(shared_expert_size=8))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    undecayed = _names(model, no_decay["params"])
    assert "tok_embeddings.weight" in undecayed
    assert "norm.weight" in undecayed and "blocks.0.attn_norm.weight" in undecayed
    assert "blocks.0.ffn.experts.bias" in undecayed
    decayed = _names(model, decay["params"])
    assert {
        "lm_head.weight",
        "blocks.0.ffn.router.layer.weight",
        "blocks.0.ffn.experts.mlp.w1",
        "blocks.1.ffn.shared_expert.w2.weight",
        "blocks.0.attn.q_proj.weight",
    } <= decayed
    # every parameter in exactly one group; the 1-D ones never decayed
    assert decayed.isdisjoint(undecayed)
    assert decayed | undecayed == {name for name, _ in model.named_parameters()}
    assert all(p.ndim == 2 for p in decay["params"])


def test_param_groups_do_not_depend_on_parameter_shapes():
    """FSDP1 (use_orig_params) shows the optimizer 1-D shards: the groups must stay the same."""
    model = Transformer(tiny(shared_expert_size=8))
    expected = [_names(model, group["params"]) for group in param_groups(model, weight_decay=0.1)]
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().flatten()))
    assert [_names(model, group["params"]) for group in param_groups(model, weight_decay=0.1)] == expected


def test_tied_head_is_the_undecayed_embedding():
    model = Transformer(tiny(dense=True, tie_embeddings=True))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert any(p is model.tok_embeddings.weight for p in no_decay["params"])
    assert not any(p is model.tok_embeddings.weight for p in decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == sum(p.numel() for p in model.parameters())


def test_cosine_schedule_warms_up_then_decays_to_the_floor():
    cfg = OptimConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(step, cfg, total_steps=14) for step in range(14)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    assert all(a >= b for a, b in zip(values[3:], values[4:], strict=False))


def test_wsd_schedule_is_flat_then_decays_linearly_over_the_last_fraction():
    cfg = OptimConfig(warmup_steps=2, schedule="wsd", decay_fraction=0.25, min_lr_ratio=0.0)
    values = [lr_multiplier(step, cfg, total_steps=20) for step in range(20)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:15] == [1.0] * 13
    assert values[15:] == pytest.approx([0.8, 0.6, 0.4, 0.2, 0.0])


def test_constant_schedule_and_scheduler_follow_the_multiplier():
    model = Transformer(tiny(dense=True))
    cfg = OptimConfig(lr=0.01, warmup_steps=2, schedule="constant")
    optimizer, scheduler = build_optimizer(model, cfg, total_steps=0)
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.005, 0.01, 0.01, 0.01])
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)


def test_a_rewarmed_schedule_runs_each_phase_as_its_own_schedule():
    cfg = OptimConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1, rewarm_at=14)
    single = OptimConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(step, cfg, total_steps=34) for step in range(34)]
    assert values[:14] == [lr_multiplier(step, single, total_steps=14) for step in range(14)]
    assert values[13] == pytest.approx(0.1)  # the first phase has decayed by the re-warm
    assert values[14:18] == [0.25, 0.5, 0.75, 1.0]  # warmed up again
    assert values[14:] == [lr_multiplier(step, single, total_steps=20) for step in range(20)]
    with pytest.raises(ConfigError, match="^optim.rewarm_at: must be below the run's 14 steps, got 14"):
        build_optimizer(Transformer(tiny(dense=True)), cfg, total_steps=14)


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"schedule": "linear"}, "optim.schedule"),
        ({"lr": 0.0}, "optim.lr"),
        ({"betas": (0.9,)}, "optim.betas"),
        ({"warmup_steps": -1}, "optim.warmup_steps"),
        ({"decay_fraction": 0.0}, "optim.decay_fraction"),
        ({"min_lr_ratio": 2.0}, "optim.min_lr_ratio"),
        ({"weight_decay": -0.1}, "optim.weight_decay"),
        ({"implementation": "apex"}, "optim.implementation"),
        ({"rewarm_at": 4, "warmup_steps": 4}, "optim.rewarm_at"),
    ],
)
def test_optim_config_errors_name_the_field(fields, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        OptimConfig(**fields)


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for_loop"])
def test_every_adamw_implementation_takes_the_same_step(implementation):
    torch.manual_seed(0)
    model = Transformer(tiny())
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs_BL, targets_BL = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    results = {}
    for kind in ("for_loop", implementation):
        model.load_state_dict(reference, strict=False)
        optimizer, _ = build_optimizer(model, OptimConfig(implementation=kind, warmup_steps=0), total_steps=10)
        model.zero_grad()
        model(inputs_BL, targets_BL).ce.backward()
        optimizer.step()
        results[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in results["for_loop"].items():
        torch.testing.assert_close(
            results[implementation][name], value, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )
