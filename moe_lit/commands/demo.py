"""``moe-lit demo``: until training lands, an end-to-end forward/backward of a dense and an MoE model."""

from __future__ import annotations

import argparse

import torch

from moe_lit.accounting import accounting_rows, markdown_table, matched_moe_config
from moe_lit.config import ModelConfig
from moe_lit.model import Transformer


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    dense = ModelConfig(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, seq_len=256, d_ff=1024)
    configs = {"dense": dense, "moe-16x2": matched_moe_config(dense, 16, 2)}
    print(markdown_table(accounting_rows(configs)))
    for name, cfg in configs.items():
        model = Transformer(cfg)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
        out = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits_BLV.flatten(0, 1), idx[:, 1:].flatten())
        (loss + out.aux_loss).backward()
        print(f"{name}: forward/backward ok, loss {loss.item():.3f} (ln V = {torch.log(torch.tensor(8192.)):.3f})")
    return 0
