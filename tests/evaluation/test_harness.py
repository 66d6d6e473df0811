import pytest
import torch
from lm_eval.api.instance import Instance

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.harness import MoeLitLM

LONG_TEXT = " ".join(["Open the file menu and choose save. The document is written to the disk."] * 6)


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def lm(exported):
    return MoeLitLM(checkpoint=exported, batch_size=3)


def reference_logprob(model, context_ids, continuation_ids):
    """Sum of log p(continuation | context) and whether it is the greedy output, one sequence at a time."""
    ids = torch.tensor([context_ids + continuation_ids])
    logprobs = torch.log_softmax(model(ids[:, :-1]).logits_BLV.float(), dim=-1)[0]
    start = len(context_ids) - 1
    picked = logprobs[start:].gather(-1, ids[0, len(context_ids) :, None])
    greedy = bool((logprobs[start:].argmax(-1) == ids[0, len(context_ids) :]).all())
    return float(picked.sum()), greedy


@torch.no_grad()
def test_loglikelihood_equals_the_models_summed_log_probs(lm):
    pairs = [
        ("Open the file menu", " and choose save."),
        ("The document", " is written to the disk."),
        ("Press the help key for more", " information."),
        ("", "You can close the window now."),
        ("Insert a table with", " three rows."),
    ]
    got = lm.loglikelihood([request("loglikelihood", *pair) for pair in pairs], disable_tqdm=True)
    for (context, continuation), (score, greedy) in zip(pairs, got, strict=False):
        whole = lm.tok_encode(context + continuation)
        context_ids = lm.tok_encode(context) if context else [lm.eot_token_id]
        continuation_ids = whole[len(lm.tok_encode(context)) :] if context else whole
        want, want_greedy = reference_logprob(lm.model, context_ids, continuation_ids)
        assert score == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy
        assert score < 0


@torch.no_grad()
def test_rolling_loglikelihood_is_the_sum_over_windows(lm):
    tokens = lm.tok_encode(LONG_TEXT)
    window = lm.max_length
    assert len(tokens) > 3 * window  # several windows, the last one partial
    want = reference_logprob(lm.model, [lm.eot_token_id], tokens[:window])[0]
    for start in range(window, len(tokens), window):
        end = min(start + window, len(tokens))
        inputs = tokens[end - window - 1 : end - 1]
        logprobs = torch.log_softmax(lm.model(torch.tensor([inputs])).logits_BLV.float(), dim=-1)[0]
        scored = logprobs[window - (end - start) :]
        want += float(scored.gather(-1, torch.tensor(tokens[start:end])[:, None]).sum())
    short = "Open the file menu."
    got_long, got_short = lm.loglikelihood_rolling(
        [request("loglikelihood_rolling", LONG_TEXT), request("loglikelihood_rolling", short)], disable_tqdm=True
    )
    assert got_long == pytest.approx(want, abs=1e-3)
    # a document is the log-likelihood of its text after end-of-text, also beyond one window
    as_continuations = lm.loglikelihood([request("loglikelihood", "", t) for t in (short, LONG_TEXT)])
    assert got_short == pytest.approx(as_continuations[0][0], abs=1e-4)
    assert got_long == pytest.approx(as_continuations[1][0], abs=1e-3)


@torch.no_grad()
def reference_greedy(lm, context, steps):
    """The adapter's former decoding: the whole (sliding) window through the model per token."""
    ids = lm.tok_encode(context)
    out = []
    for _ in range(steps):
        token = int(lm.model(torch.tensor([(ids + out)[-lm.max_length :]])).logits_BLV[0, -1].argmax())
        if token == lm.eot_token_id:
            break
        out.append(token)
    return lm.tok_decode(out)


def test_generation_is_greedy_and_stops_at_stop_sequences(lm):
    contexts = ["Open the file menu", "Sie können das Fenster", LONG_TEXT]  # the last one slides the window
    assert len(lm.tok_encode(LONG_TEXT)) + 12 > lm.max_length
    free = lm.generate_until(
        [request("generate_until", c, {"until": [], "max_gen_toks": 12}) for c in contexts], disable_tqdm=True
    )
    assert free == [reference_greedy(lm, c, 12) for c in contexts]
    assert all(len(text) >= 6 for text in free)
    stop = free[0][3:5]
    cut = lm.generate_until([request("generate_until", contexts[0], {"until": ["#never#", stop], "max_gen_toks": 12})])
    assert cut == [free[0][: free[0].index(stop)]]
    shorter = lm.generate_until([request("generate_until", contexts[1], {"until": "#never#", "max_gen_toks": 3})])
    assert shorter == [reference_greedy(lm, contexts[1], 3)]


def test_registered_in_lm_eval_and_built_from_an_arg_string(exported):
    from lm_eval.api.registry import get_model

    cls = get_model("moe_lit")
    assert cls is MoeLitLM
    lm = cls.create_from_arg_string(f"checkpoint={exported},batch_size=2", {"device": "cpu"})
    assert (lm.batch_size, lm.max_length) == (2, 32)


def test_user_errors_are_one_line_moe_lit_errors(tmp_path, exported, lm):
    with pytest.raises(MoeLitError, match="no such file"):
        MoeLitLM(checkpoint=tmp_path / "missing.ckpt")
    with pytest.raises(MoeLitError, match="batch_size"):
        MoeLitLM(checkpoint=exported, batch_size="auto")
    with pytest.raises(MoeLitError, match="greedily"):
        lm.generate_until([request("generate_until", "Open", {"do_sample": True})])


def test_checkpoint_names_skip_generic_folders_and_never_collide(tmp_path):
    from moe_lit.evaluation.harness import checkpoint_name, default_out

    (tmp_path / "demo" / "models" / "tiny-moe").mkdir(parents=True)
    for run in ("a", "b"):
        (tmp_path / run / "version_1" / "checkpoints").mkdir(parents=True)
        (tmp_path / run / "version_1" / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert checkpoint_name(tmp_path / "demo" / "models" / "tiny-moe").startswith("demo-tiny-moe-")
    a, b = (checkpoint_name(tmp_path / run / "version_1" / "checkpoints" / "last.ckpt") for run in ("a", "b"))
    assert a.startswith("version_1-last-") and b.startswith("version_1-last-") and a != b
    assert default_out(tmp_path / "demo" / "models" / "tiny-moe", "eval").parts[:2] == ("runs", "eval")


def test_sparsity_option_at_zero_keeps_scores_and_needs_calibration(exported, tmp_path):
    from moe_lit.inference.sparsity import SparseExperts

    text = tmp_path / "calib.txt"
    text.write_text(LONG_TEXT)
    dense = MoeLitLM(checkpoint=exported)
    exact = MoeLitLM(checkpoint=exported, sparsity="0.0", calibration=str(text))
    sparse = MoeLitLM(checkpoint=exported, sparsity="0.9", sparsity_granularity="expert", calibration=str(text))
    assert any(isinstance(m, SparseExperts) for m in sparse.model.modules())
    reqs = [request("loglikelihood", "Open the file", " menu and choose save.")]
    want = dense.loglikelihood(reqs)[0][0]
    assert exact.loglikelihood(reqs)[0][0] == pytest.approx(want, abs=1e-4)
    assert sparse.loglikelihood(reqs)[0][0] != pytest.approx(want, abs=1e-4)
    with pytest.raises(MoeLitError, match="calibration"):
        MoeLitLM(checkpoint=exported, sparsity="0.5")
    with pytest.raises(MoeLitError, match="sparsity.rule"):
        MoeLitLM(checkpoint=exported, sparsity="0.5", sparsity_rule="up", calibration=str(text))


def test_lm_eval_records_no_git_hash_outside_a_checkout_and_prints_nothing(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator

    from moe_lit.evaluation.harness import quiet_git_hash

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no checkout above tmp_path
    with quiet_git_hash():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""
