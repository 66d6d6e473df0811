"""The real default source: two Debian packages (cached under $MOE_LIT_CACHE after the first run)."""

import json

import pytest

from moe_lit.data.layout import text_file
from moe_lit.data.prepare import PrepareConfig, prepare


@pytest.mark.slow
def test_debian_source_is_parallel_and_translated(tmp_path):
    meta = prepare(
        PrepareConfig(languages=["en", "de"], out=tmp_path / "out", vocab_size=512, max_paragraphs=300, progress=False)
    )
    assert meta["languages"] == ["en", "de"] and meta["vocab_size"] == 512
    assert sum(meta["paragraphs"][split]["de"] for split in meta["paragraphs"]) == 300
    rows = {
        lang: [json.loads(line) for line in text_file(tmp_path / "out", "train", lang).open()] for lang in ("en", "de")
    }
    english = {row["id"]: row["text"] for row in rows["en"]}
    assert {row["id"] for row in rows["de"]} == set(english)  # capped to shared ids
    assert all(row["text"] != english[row["id"]] for row in rows["de"])  # fallbacks were dropped
    assert all(row["id"].startswith(row["doc"] + "#") and row["doc"].endswith(".html") for row in rows["de"])
