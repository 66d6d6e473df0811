import json
import math
from pathlib import Path

import pytest

from moe_lit.errors import MoeLitError
from moe_lit.evaluation.harness import MoeLitLM, evaluate, result_rows
from moe_lit.evaluation.tasks import SuiteConfig, build_items, read_parallel, resolve_tasks
from tests.helpers.corpus import LANGUAGES, PARAGRAPHS

FIXTURES = Path(__file__).resolve().parents[2] / "eval" / "fixtures"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def lm(exported):
    return MoeLitLM(checkpoint=exported, batch_size=4)


def test_suite_items_are_the_same_in_every_language(prepared_dir):
    from moe_lit.evaluation.tasks import paragraph_index

    assert paragraph_index(prepared_dir, LANGUAGES) is None  # no "pos": previous test paragraph
    items = build_items(read_parallel(prepared_dir), SuiteConfig(num_distractors=2))
    for kind, per_lang in items.items():
        ids = {lang: [item["id"] for item in per_lang[lang]] for lang in LANGUAGES}
        assert len({tuple(v) for v in ids.values()}) == 1, kind
    assert [doc["text"].split("\n") for doc in items["ppl"]["de"]] == [PARAGRAPHS["de"][:4], PARAGRAPHS["de"][4:]]
    # 2 documents x 3 consecutive pairs; the answer is the paragraph after the context, in every language
    assert len(items["next"]["en"]) == 6
    for lang in LANGUAGES:
        for item in items["next"][lang]:
            here = PARAGRAPHS[lang].index(item["context"])
            assert item["choices"][item["label"]] == PARAGRAPHS[lang][here + 1]
            assert len(item["choices"]) == 3 and len(set(item["choices"])) == 3
    labels = {lang: [item["label"] for item in items["next"][lang]] for lang in LANGUAGES}
    assert labels["en"] == labels["de"] == labels["fr"]
    for lang in LANGUAGES:
        assert len(items["pairs"][lang]) == 8
        for pair in items["pairs"][lang]:
            assert pair["good"] in PARAGRAPHS[lang]
            good, bad = pair["good"].split(), pair["bad"].split()
            assert bad != good and sorted(bad) == sorted(good) and bad[0] == good[0]


def test_parallel_reader_keeps_only_shared_ids(tmp_path, prepared_dir):
    text = tmp_path / "text" / "test"
    text.mkdir(parents=True)
    (text / "en.jsonl").write_text((prepared_dir / "text" / "test" / "en.jsonl").read_text())
    fr = (prepared_dir / "text" / "test" / "fr.jsonl").read_text().splitlines()
    (text / "fr.jsonl").write_text("\n".join(fr[:3]) + "\n")
    parallel = read_parallel(tmp_path, languages=["en", "fr"])
    assert [r["id"] for r in parallel["en"]] == [r["id"] for r in parallel["fr"]] == ["p0", "p1", "p2"]
    with pytest.raises(MoeLitError, match="no meta.json"):
        read_parallel(tmp_path)


def test_local_suite_runs_through_simple_evaluate_offline(tmp_path, prepared_dir, lm):
    names, manager = resolve_tasks(["moe_lit_suite"], tmp_path, data_dir=prepared_dir)
    results = evaluate(lm, names, manager, bootstrap_iters=0)
    tasks = set(results["results"])
    assert {f"moe_lit_{kind}_{lang}" for kind in ("ppl", "next", "pairs") for lang in LANGUAGES} <= tasks
    # bits per byte is the summed rolling log-likelihood of the documents over their UTF-8 bytes
    docs = [json.loads(line)["text"] for line in (tmp_path / "data" / "ppl_de.jsonl").read_text().splitlines()]
    from lm_eval.api.instance import Instance

    lls = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), 0) for d in docs], disable_tqdm=True)
    want = -sum(lls) / sum(len(d.encode()) for d in docs) / math.log(2)
    assert results["results"]["moe_lit_ppl_de"]["bits_per_byte,none"] == pytest.approx(want, rel=1e-6)
    rows = {(r["task"], r["metric"]): r for r in result_rows(results)}
    assert rows[("moe_lit_next_fr", "acc")]["n"] == 6
    assert 0.0 <= rows[("moe_lit_pairs_en", "acc")]["value"] <= 1.0


def test_builtin_prompt_runs_on_local_jsonl(tmp_path, lm):
    task_data = {"xcopa_it": FIXTURES / "xcopa_it.jsonl", "xstorycloze_en": FIXTURES / "xstorycloze_en.jsonl"}
    names, manager = resolve_tasks(["xcopa_it", "xstorycloze_en"], tmp_path, task_data=task_data)
    assert names == ["xcopa_it_local", "xstorycloze_en_local"]
    results = evaluate(lm, names, manager, bootstrap_iters=0, log_samples=True)
    assert results["n-samples"]["xcopa_it_local"]["effective"] == 4
    assert results["n-samples"]["xstorycloze_en_local"]["effective"] == 4
    first = results["samples"]["xcopa_it_local"][0]["arguments"]
    # xcopa's Italian prompt: premise without its period + "quindi" (effect); choices lower-cased
    assert first[0] == ("La finestra era aperta quindi", " nella stanza entrava aria fresca.")
    story = results["samples"]["xstorycloze_en_local"][1]
    assert story["target"] == 1 and story["arguments"][1][1] == " Tom had to write the letter again."


def test_unreachable_dataset_is_a_user_error(tmp_path, lm, monkeypatch):
    import datasets.config
    import huggingface_hub.constants
    from lm_eval.tasks import TaskManager

    # NOTE: offline as the users this error is for are (and as this machine is): online, the hub
    # client retries the network for many seconds before it gives up the same way. The libraries
    # read the flags once, at import, so the test sets their constants.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    (tmp_path / "remote.yaml").write_text(
        "task: remote_only\ndataset_path: nobody/no_such_dataset_xyz\noutput_type: loglikelihood\n"
        "test_split: test\ndoc_to_text: a\ndoc_to_target: b\n"
    )
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with pytest.raises(MoeLitError, match="not reachable.*--task-data TASK=FILE"):
        evaluate(lm, ["remote_only"], manager)


def test_unknown_task_is_a_user_error(tmp_path):
    with pytest.raises(MoeLitError, match="unknown task 'no_such_task_xyz'"):
        resolve_tasks(["no_such_task_xyz"], tmp_path)
    with pytest.raises(MoeLitError, match="needs a prepared data dir"):
        resolve_tasks(["moe_lit_suite"], tmp_path)
    with pytest.raises(MoeLitError, match="not among --tasks"):
        resolve_tasks(["moe_lit_suite"], tmp_path, task_data={"xcopa_it": FIXTURES / "xcopa_it.jsonl"})


def test_next_paragraph_context_is_the_true_previous_paragraph_from_any_split(tmp_path):
    from moe_lit.evaluation.tasks import paragraph_index

    # one document of six paragraphs; test keeps positions 1, 3, 5, train the others
    texts = {lang: [f"{lang} paragraph number {i} of the help page." for i in range(6)] for lang in ("en", "de")}
    for split, kept in (("test", (1, 3, 5)), ("train", (0, 2, 4))):
        (tmp_path / "text" / split).mkdir(parents=True)
        for lang, paras in texts.items():
            lines = [json.dumps({"id": f"p{i}", "doc": "d", "pos": i, "text": paras[i]}) for i in kept]
            (tmp_path / "text" / split / f"{lang}.jsonl").write_text("\n".join(lines) + "\n")
    parallel = read_parallel(tmp_path, languages=["en", "de"])
    items = build_items(parallel, SuiteConfig(), paragraph_index(tmp_path, ["en", "de"]))["next"]
    for lang in ("en", "de"):
        assert [item["id"] for item in items[lang]] == ["p1", "p3", "p5"]
        for item in items[lang]:
            answer = int(item["id"][1:])
            assert item["context"] == texts[lang][answer - 1]  # a train paragraph
            assert item["choices"][item["label"]] == texts[lang][answer]
            assert sorted(item["choices"]) == sorted(texts[lang][i] for i in (1, 3, 5))
