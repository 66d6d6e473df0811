import pytest

from moe_lit.checkpoint import load_model
from moe_lit.console_script import main
from moe_lit.data.tokenizer import load_tokenizer
from moe_lit.inference import generate


def expected(checkpoint, prompt, steps):
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    return prompt + tokenizer.decode(generate(load_model(checkpoint), [ids], steps, stop_tokens=[eot])[0])


def test_generate_prints_greedy_continuations_and_streams_the_same(exported, capsys):  # noqa: F811
    prompts = ["Open the file", "Sie können"]
    args = ["generate", "--checkpoint", str(exported), "--max-new-tokens", "8"]
    assert main([*args, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [expected(exported, p, 8) for p in prompts]
    assert main([*args, "--prompt", prompts[0], "--stream"]) == 0
    assert capsys.readouterr().out == lines[0] + "\n"


@pytest.mark.slow
def test_generate_compile_prints_the_eager_continuations(exported, capsys):  # noqa: F811
    prompts = ["Open the file", "Sie können"]
    args = ["generate", "--checkpoint", str(exported), "--max-new-tokens", "8", "--compile"]
    assert main([*args, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    assert capsys.readouterr().out.splitlines() == [expected(exported, p, 8) for p in prompts]


def test_generate_sampling_seed_and_sparsity(exported, tmp_path, capsys):  # noqa: F811
    args = ["generate", "--checkpoint", str(exported), "--prompt", "Open", "--max-new-tokens", "8"]
    sampled = [*args, "--temperature", "1.5", "--seed", "7"]
    assert main(sampled) == 0
    first = capsys.readouterr().out
    assert main(sampled) == 0
    assert capsys.readouterr().out == first
    calib = tmp_path / "calib.txt"
    calib.write_text("Open the file menu and choose save. The document is written to the disk.")
    assert main([*args, "--sparsity", "0", "--calibration", str(calib)]) == 0
    assert capsys.readouterr().out.strip() == expected(exported, "Open", 8)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt", "a", "--prompt", "b", "--stream"], "--stream"),
        (["--prompt", "a", "--sparsity", "0.5"], "--calibration"),
        (["--prompt", "a", "--sparsity", "1.5", "--calibration", "x"], "sparsity.target"),
        (["--prompt", "a", "--top-p", "2"], "top_p"),
    ],
)
def test_generate_errors_are_one_line_exit_2(exported, capsys, extra, message):  # noqa: F811
    assert main(["generate", "--checkpoint", str(exported), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
