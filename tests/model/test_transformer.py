import torch

from moe_lit.model import Transformer
from tests.helpers.models import tiny


def test_forward_shapes_losses_and_backward():
    torch.manual_seed(0)
    cfg = tiny(n_kv_heads=2, z_loss_coef=1e-3, shared_expert_size=8)
    model = Transformer(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    out = model(idx)
    assert out.logits_BLV.shape == (2, cfg.seq_len, cfg.vocab_size)
    assert set(out.aux_losses) == {"load_balancing", "z_loss"}
    (out.logits_BLV.mean() + out.aux_loss).backward()
    assert model.blocks[0].ffn.router.layer.weight.grad is not None


def test_one_expert_top1_model_equals_dense_model():
    torch.manual_seed(0)
    dense = Transformer(tiny(dense=True))
    moe = Transformer(tiny(num_experts=1, expert_size=64, top_k=1))
    dense_state = dense.state_dict()
    moe_state = {}
    for name, tensor in moe.state_dict().items():
        if ".ffn.experts.mlp." in name:
            prefix, which = name.split(".ffn.experts.mlp.")
            dense_weight = dense_state[f"{prefix}.ffn.{which}.weight"]
            moe_state[name] = dense_weight.t() if which == "w2" else dense_weight
        elif name in dense_state:
            moe_state[name] = dense_state[name]
        else:
            moe_state[name] = torch.zeros_like(tensor)  # router (one expert: weight 1) and expert bias
    moe.load_state_dict(moe_state)
    idx = torch.randint(0, 97, (2, 16))
    assert (moe(idx).logits_BLV - dense(idx).logits_BLV).abs().max().item() < 1e-5


def test_causality_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = Transformer(tiny()).eval()
    idx = torch.randint(0, 97, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 97
    a, b = model(idx).logits_BLV, model(changed).logits_BLV
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_state_dict_keys_follow_megablocks_dmoe_layout():
    model = Transformer(tiny(num_experts=4, expert_size=16))
    keys = {k.split("blocks.0.ffn.")[1] for k in model.state_dict() if k.startswith("blocks.0.ffn.")}
    assert keys == {"router.layer.weight", "experts.mlp.w1", "experts.mlp.v1", "experts.mlp.w2", "experts.bias"}
    assert model.blocks[0].ffn.experts.mlp.w1.shape == (4 * 16, 32)
    bias_model = Transformer(tiny(balancing="bias"))
    assert "blocks.0.ffn.router.expert_bias" in bias_model.state_dict()
    assert "blocks.0.ffn.router.tokens_per_expert" not in bias_model.state_dict()
