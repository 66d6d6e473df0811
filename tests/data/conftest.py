"""The tiny three-script corpus of tests.helpers.corpus, written and prepared once per test session."""

import pytest

from moe_lit.data.prepare import PrepareConfig, prepare
from tests.helpers.corpus import VOCAB, write_corpus


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
