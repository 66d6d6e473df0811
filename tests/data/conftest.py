"""A tiny parallel corpus in three scripts, prepared once per test session.

Each language writes its words with its own letters (en: a-h, de: j-q, ru: Cyrillic), so the
language of any decoded token block is visible from its characters.
"""

import random

import pytest

from moe_lit.data.prepare import PrepareConfig, prepare

ALPHABETS = {"en": "abcdefgh", "de": "jklmnopq", "ru": "абвгдежз"}
FILES = 4
PARAGRAPHS_PER_FILE = 60
VOCAB = 300


def write_corpus(root, alphabets=ALPHABETS, files=FILES, paragraphs=PARAGRAPHS_PER_FILE, seed=0):
    """``root/<lang>/doc<i>.txt``: the same file names and paragraph counts in every language."""
    rng = random.Random(seed)
    for lang, letters in alphabets.items():
        (root / lang).mkdir(parents=True)
        for i in range(files):
            pars = []
            for _ in range(paragraphs):
                words = ["".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(rng.randint(15, 30))]
                pars.append(" ".join(words[:10]) + "\n" + " ".join(words[10:]))
            (root / lang / f"doc{i}.txt").write_text("\n\n".join(pars) + "\n", encoding="utf-8")
    return root


def language_of(text: str) -> str:
    """The fixture language whose letters occur in ``text`` (exactly one must)."""
    found = [lang for lang, letters in ALPHABETS.items() if any(ch in letters for ch in text)]
    assert len(found) == 1, (text, found)
    return found[0]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def prepared(corpus_dir, tmp_path_factory):
    """The prepared directory of the fixture corpus (vocab 300, 10 % val, 10 % test)."""
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(
        PrepareConfig(
            source=str(corpus_dir), out=out, vocab_size=VOCAB, val_fraction=0.1, test_fraction=0.1, progress=False
        )
    )
    return out
