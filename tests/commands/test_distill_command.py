"""``moe-lit distill``: a converted dense student trained on its MoE teacher through train_run."""

import json

import pytest
import torch

from moe_lit.checkpoint import export_model, load_model
from moe_lit.console_script import main
from moe_lit.convert.moe_to_dense import MoeToDenseConfig, moe_to_dense
from moe_lit.data.prepare import PrepareConfig, prepare
from moe_lit.evaluation.routing_trace import routing_trace
from moe_lit.model import Transformer
from tests.helpers.corpus import write_corpus
from tests.helpers.models import tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Prepared data, an exported MoE teacher and its dense conversion (the student)."""
    root = tmp_path_factory.mktemp("distill")
    data = root / "data"
    prepare(
        PrepareConfig(
            source=str(write_corpus(root / "corpus", files=2, paragraphs=20)),
            out=data,
            vocab_size=300,
            val_fraction=0.1,
            test_fraction=0.1,
            progress=False,
        )
    )
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    teacher = Transformer(tiny(vocab_size=vocab, seq_len=16)).eval()
    with torch.no_grad(), routing_trace(teacher, record_inputs=True) as recorder:
        teacher(torch.randint(0, vocab, (2, 16)))
    student, _ = moe_to_dense(teacher, recorder.trace(), MoeToDenseConfig(score="frequency", keep=2, groups=2))
    tokenizer = data / "tokenizer.json"
    return data, export_model(teacher, root / "teacher", tokenizer), export_model(student, root / "student", tokenizer)


def _distill(pair, out, *extra):
    data, teacher, student = pair
    return main(
        [
            "distill",
            "--teacher",
            str(teacher),
            "--student",
            str(student),
            f"--data.data_dir={data}",
            "--train.max_tokens",
            "128",
            "--data.seq_len",
            "16",
            "--data.batch_size",
            "4",
            "--data.val_batches",
            "1",
            "--train.val_every",
            "2",
            "--optim.warmup_steps",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_distills_the_student_and_leaves_the_teacher(pair, tmp_path, capsys):
    _, teacher_dir, student_dir = pair
    teacher_bytes = (teacher_dir / "model.safetensors").read_bytes()
    assert _distill(pair, tmp_path / "run") == 0
    report = json.loads((tmp_path / "run" / "distill.json").read_text())
    assert report["result"]["steps"] == 2 and report["result"]["tokens"] == 128
    distilled, student = load_model(tmp_path / "run" / "model"), load_model(student_dir)
    assert distilled.config == student.config
    assert any(
        not torch.equal(a, b)
        for a, b in zip(distilled.state_dict().values(), student.state_dict().values(), strict=False)
    )
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()
    assert (teacher_dir / "model.safetensors").read_bytes() == teacher_bytes
    assert "val loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--distill.temperature", "0"], "distill.temperature: must be > 0"),
        (["--distill.kl_weight", "0", "--distill.ce_weight", "0"], "kl_weight and ce_weight are both 0"),
        (["--data.seq_len", "32"], "data.seq_len: 32 exceeds the teacher's seq_len 16"),
        (["--train.max_tokens", "0"], "train.max_tokens: must be a positive integer, got 0"),
        (["--train.max_token", "9"], "train: unknown key(s) ['max_token'], allowed keys: ['max_tokens'"),
        (["--colour.red", "1"], "settings: unknown section(s) ['colour'], allowed sections: ['data'"),
        (["--optim.lr"], "--optim.lr: needs a value"),
    ],
)
def test_bad_input_is_one_line_exit_2(pair, tmp_path, capsys, extra, message):
    assert _distill(pair, tmp_path / "bad", *extra) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "bad").exists()


def test_out_is_never_an_input_and_busy_needs_force(pair, tmp_path, capsys):
    _, teacher, _ = pair
    assert _distill(pair, teacher, "--force") == 2
    assert "is or contains the input --teacher" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert _distill(pair, busy) == 2
    assert "pass --force" in capsys.readouterr().err
