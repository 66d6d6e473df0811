"""``moe-lit analyze text``: the routing of one text, token by token."""

import json

import torch
from tokenizers import Tokenizer

from moe_lit.checkpoint import export_model
from moe_lit.console_script import main
from moe_lit.evaluation.routing_trace import routing_trace
from moe_lit.model import Transformer
from tests.helpers.models import tiny

TEXT = "Open the file menu and choose save."


def test_each_token_lists_the_experts_the_model_routes_it_to(exported, prepared_dir, tiny_moe, capsys):
    assert main(["analyze", "text", "--checkpoint", str(exported), "--text", TEXT, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    tokenizer = Tokenizer.from_file(str(prepared_dir / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert [row["id"] for row in rows] == ids and "".join(row["token"] for row in rows) == TEXT
    with torch.no_grad(), routing_trace(tiny_moe) as recorder:  # the same text inside a batch of two
        tiny_moe(torch.tensor([ids, ids[::-1]]))
    trace = recorder.trace()
    for n, row in enumerate(rows):
        assert list(row["layers"]) == [str(i) for i in tiny_moe.config.moe_layer_ids]
        for m, experts in enumerate(row["layers"].values()):
            assert [e for e, _ in experts] == trace.indices_MNK[m, n].tolist()
            assert torch.allclose(torch.tensor([w for _, w in experts]), trace.weights_MNK[m, n], atol=1e-4)


def test_table_has_a_row_per_token_and_a_column_per_moe_layer(exported, capsys):
    assert main(["analyze", "text", "--checkpoint", str(exported), "--text", TEXT]) == 0
    header, *body = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["pos", "token", "layer", "0", "layer", "1"]
    assert len(body) == len(json.loads(_json(exported, capsys))) and body[0].startswith("0 ")
    assert all(line.count(" e") >= 2 * 2 for line in body)  # top-2 in two layers


def _json(exported, capsys) -> str:
    main(["analyze", "text", "--checkpoint", str(exported), "--text", TEXT, "--json"])
    return capsys.readouterr().out


def test_dense_model_and_too_long_text_are_one_line_errors(tmp_path, exported, prepared_dir, capsys):
    dense = export_model(
        Transformer(tiny(vocab_size=320, dense=True)), tmp_path / "dense", prepared_dir / "tokenizer.json"
    )
    assert main(["analyze", "text", "--checkpoint", str(dense), "--text", TEXT]) == 2
    assert main(["analyze", "text", "--checkpoint", str(exported), "--text", TEXT * 20]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "dense model" in errors[0] and "exceed the model's seq_len 32" in errors[1]
