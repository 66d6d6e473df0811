import json
import signal

import pytest

from moe_lit.data import prepare as prepare_module
from moe_lit.data.layout import SPLITS, import_litdata, read_meta, text_file, tokenizer_file, tokens_dir
from moe_lit.data.prepare import PrepareConfig, prepare
from moe_lit.data.tokenizer import EOS, load_tokenizer
from moe_lit.errors import MoeLitError
from tests.helpers.corpus import ALPHABETS, FILES, PARAGRAPHS_PER_FILE, VOCAB

LANGS = sorted(ALPHABETS)


def _rows(root, split, lang):
    with text_file(root, split, lang).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def test_layout_and_meta(prepared):
    meta = read_meta(prepared)
    assert meta["languages"] == LANGS
    tokenizer = load_tokenizer(tokenizer_file(prepared))
    assert meta["vocab_size"] == tokenizer.get_vocab_size() == VOCAB
    assert meta["eos_id"] == tokenizer.token_to_id(EOS)
    for split in SPLITS:
        for lang in LANGS:
            assert (tokens_dir(prepared, split, lang) / "index.json").is_file()
            assert meta["paragraphs"][split][lang] == len(_rows(prepared, split, lang)) > 0
    assert sum(meta["paragraphs"][s]["en"] for s in SPLITS) == FILES * PARAGRAPHS_PER_FILE


def test_token_counts_are_exact(prepared):
    """meta tokens == tokenized text + one EOS per paragraph == tokens stored by litdata."""
    meta = read_meta(prepared)
    tokenizer = load_tokenizer(tokenizer_file(prepared))
    for split in SPLITS:
        for lang in LANGS:
            texts = [row["text"] for row in _rows(prepared, split, lang)]
            expected = sum(len(enc.ids) + 1 for enc in tokenizer.encode_batch(texts))
            index = json.loads((tokens_dir(prepared, split, lang) / "index.json").read_text())
            assert meta["tokens"][split][lang] == expected == sum(chunk["dim"] for chunk in index["chunks"])


def test_litdata_stream_decodes_to_the_text(prepared):
    litdata = import_litdata()
    tokenizer = load_tokenizer(tokenizer_file(prepared))
    rows = _rows(prepared, "train", "ru")
    dataset = litdata.StreamingDataset(str(tokens_dir(prepared, "train", "ru")), item_loader=litdata.TokensLoader(64))
    decoded = "".join(tokenizer.decode(dataset[i].tolist(), skip_special_tokens=False) for i in range(3))
    expected = "".join(row["text"] + EOS for row in rows)
    assert expected.startswith(decoded) and len(decoded) > 100


def test_split_is_parallel_disjoint_and_complete(prepared):
    ids = {(split, lang): [row["id"] for row in _rows(prepared, split, lang)] for split in SPLITS for lang in LANGS}
    for split in SPLITS:
        assert ids[(split, "en")] == ids[(split, "de")] == ids[(split, "ru")]
        assert read_meta(prepared)["parallel_ids"][split] == len(ids[(split, "en")])
    everything = [pid for split in SPLITS for pid in ids[(split, "en")]]
    assert len(everything) == len(set(everything)) == FILES * PARAGRAPHS_PER_FILE
    row = _rows(prepared, "test", "de")[0]
    assert row["id"] == f"{row['doc']}#{row['pos']}"


def test_second_run_reuses_and_force_rebuilds(prepared, corpus_dir, capsys):
    cfg = dict(source=str(corpus_dir), out=prepared, vocab_size=VOCAB, val_fraction=0.1, test_fraction=0.1)
    before = read_meta(prepared)
    assert prepare(PrepareConfig(**cfg)) == before
    assert "reusing it" in capsys.readouterr().out
    changed = prepare(PrepareConfig(**{**cfg, "force": True, "progress": False}))
    assert changed["tokens"] == before["tokens"]
    assert "reusing" not in capsys.readouterr().out


def test_preparing_leaves_the_sigint_handler_as_it_was(corpus_dir, tmp_path):
    before = signal.getsignal(signal.SIGINT)  # litdata's optimize would leave one that exits 0
    prepare(PrepareConfig(source=str(corpus_dir), out=tmp_path / "out", vocab_size=VOCAB, progress=False))
    assert signal.getsignal(signal.SIGINT) is before


def test_failure_leaves_nothing_that_looks_prepared(corpus_dir, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare_module, "write_tokens", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare(PrepareConfig(source=str(corpus_dir), out=tmp_path / "out", vocab_size=VOCAB, progress=False))
    assert list(tmp_path.iterdir()) == []


def test_reusing_a_tokenizer(prepared, corpus_dir, tmp_path):
    meta = prepare(
        PrepareConfig(
            source=str(corpus_dir),
            languages=["de"],
            out=tmp_path / "de",
            tokenizer=tokenizer_file(prepared),
            val_fraction=0.1,
            test_fraction=0.1,
            progress=False,
        )
    )
    assert meta["languages"] == ["de"]
    assert meta["tokens"]["train"]["de"] == read_meta(prepared)["tokens"]["train"]["de"]
    assert tokenizer_file(tmp_path / "de").read_text() == tokenizer_file(prepared).read_text()


def test_other_content_is_refused_unless_force_and_the_source_always(corpus_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = dict(source=str(corpus_dir), vocab_size=VOCAB, val_fraction=0.1, test_fraction=0.1, progress=False)
    with pytest.raises(MoeLitError, match="--out: .* exists and is not empty; pass --force"):
        prepare(PrepareConfig(out=out, **cfg))
    assert (out / "notes.txt").is_file()
    with pytest.raises(MoeLitError, match="is or contains the input --source"):
        prepare(PrepareConfig(out=corpus_dir.parent, force=True, **cfg))
    prepare(PrepareConfig(out=out, force=True, **cfg))
    assert not (out / "notes.txt").exists() and read_meta(out)["vocab_size"] == VOCAB


@pytest.mark.parametrize(
    ("empty", "hint"),
    [
        ("val", "raise --val-fraction"),
        ("test", "raise --test-fraction"),
        ("train", "lower --val-fraction / --test-fraction"),
    ],
)
def test_an_empty_split_hint_never_shrinks_training_to_fill_another(empty, hint):
    from moe_lit.data.prepare import _check_nonempty

    splits = {split: {"en": [] if split == empty else ["a paragraph"]} for split in ("train", "val", "test")}
    with pytest.raises(MoeLitError) as caught:
        _check_nonempty(splits)
    assert str(caught.value) == (
        f"language(s) en: no paragraphs in the {empty} split; the source is too small "
        f"(add text, raise --max-paragraphs, or {hint})"
    )
