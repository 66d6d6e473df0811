import pytest
import torch

from moe_lit.checkpoint import export_model, load_model
from moe_lit.errors import MoeLitError
from moe_lit.model import Transformer
from tests.conftest import tiny


@pytest.mark.parametrize("cfg", [tiny(), tiny(dense=True, tie_embeddings=True), tiny(balancing="bias")])
def test_export_and_load_round_trip_bit_for_bit(tmp_path, cfg):
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    if cfg.is_moe and cfg.moe.balancing == "bias":
        model.blocks[0].ffn.router.expert_bias.fill_(0.25)
    out = export_model(model, tmp_path / "export")
    again = load_model(out)
    idx = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.equal(model(idx).logits_BLV, again(idx).logits_BLV)
    assert again.config == cfg
    assert not list(tmp_path.glob(".export*"))  # no temporary directory left behind


def test_missing_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(MoeLitError, match="no such file"):
        load_model(tmp_path / "nope.ckpt")
