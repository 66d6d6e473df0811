"""Multilingual paragraph corpora: sources, cleaning and the parallel train/val/test split.

A source yields, per language, paragraphs in document order. Three sources exist:

- ``debian`` (default): LibreOffice help pages from Debian packages (see :mod:`moe_lit.data.debian`);
  paragraph ids are shared by all languages, so the corpus is parallel.
- a local folder ``DIR/<lang>/*.txt``: paragraphs separated by blank lines; the id of a paragraph
  is ``<file>#<index>``, so equally named files in two languages are parallel.
- ``hf:NAME``: a Hugging Face dataset with one config per language and a ``text`` column
  (needs ``datasets`` and a reachable hub).

The split is a pure function of the paragraph id, so a paragraph id lands in the same split in
every language and the test split of a parallel source is a parallel corpus.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from moe_lit.data.layout import SPLITS
from moe_lit.errors import MoeLitError

HF_PREFIX = "hf:"
LOCAL_FOLDER_HINT = "use a local folder instead: moe-lit data prepare --source DIR (DIR/<lang>/*.txt)"


@dataclass(frozen=True)
class Paragraph:
    """One paragraph of one language."""

    id: str
    """Paragraph id, shared by the translations of the same paragraph."""
    doc: str
    """The document (help page, text file, dataset row) the paragraph belongs to."""
    pos: int
    """Index of the paragraph within its document, before any filtering."""
    text: str
    """The paragraph text."""

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "doc": self.doc, "pos": self.pos, "text": self.text}


def normalize(text: str) -> str:
    """Collapse every run of whitespace (newlines included) into one space."""
    return " ".join(text.split())


def clean(paragraphs: Iterable[Paragraph], fallback: dict[str, str] | None = None) -> list[Paragraph]:
    """Normalise whitespace, drop empty paragraphs, untranslated fallbacks and duplicates.

    ``fallback`` maps paragraph ids to the source-language (English) text: a paragraph whose text
    equals it was never translated. Of paragraphs with equal text, the first one is kept.
    """
    kept: list[Paragraph] = []
    seen: set[str] = set()
    for par in paragraphs:
        text = normalize(par.text)
        if not text or text in seen or (fallback is not None and fallback.get(par.id) == text):
            continue
        seen.add(text)
        kept.append(Paragraph(par.id, par.doc, par.pos, text))
    return kept


def _unit_hash(key: str, salt: str) -> float:
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=salt.encode()[:16]).digest()
    return int.from_bytes(digest, "big") / 2**64


def split_of(paragraph_id: str, val_fraction: float, test_fraction: float) -> str:
    """``train``, ``val`` or ``test``: a pure function of the paragraph id."""
    u = _unit_hash(paragraph_id, "split")
    if u < test_fraction:
        return "test"
    return "val" if u < test_fraction + val_fraction else "train"


def split_paragraphs(
    paragraphs: list[Paragraph], val_fraction: float, test_fraction: float
) -> dict[str, list[Paragraph]]:
    """Paragraphs per split, each list in the original (document) order."""
    splits: dict[str, list[Paragraph]] = {split: [] for split in SPLITS}
    for par in paragraphs:
        splits[split_of(par.id, val_fraction, test_fraction)].append(par)
    return splits


def cap(corpus: dict[str, list[Paragraph]], max_paragraphs: int | None) -> dict[str, list[Paragraph]]:
    """At most ``max_paragraphs`` per language, preferring ids that more languages share.

    Ids are ranked by how many languages have them, then by a hash of the id, so a capped parallel
    corpus stays parallel; each language keeps its best-ranked ids, in document order.
    """
    if max_paragraphs is None:
        return corpus
    coverage = Counter(par.id for paragraphs in corpus.values() for par in paragraphs)
    capped = {}
    for lang, paragraphs in corpus.items():
        ranked = sorted(paragraphs, key=lambda par: (-coverage[par.id], _unit_hash(par.id, "cap")))
        chosen = {par.id for par in ranked[:max_paragraphs]}
        capped[lang] = [par for par in paragraphs if par.id in chosen]
    return capped


def source_kind(source: str) -> str:
    """``debian``, ``hf`` or ``local`` for a ``--source`` value."""
    if source == "debian":
        return "debian"
    return "hf" if source.startswith(HF_PREFIX) else "local"


# ---------------------------------------------------------------------------------------------
# local folder: DIR/<lang>/*.txt
# ---------------------------------------------------------------------------------------------


def local_languages(root: Path) -> list[str]:
    """Language folders of a local source: sub-folders holding at least one ``*.txt`` file."""
    if not root.is_dir():
        raise MoeLitError(
            f"--source: {str(root)!r} is neither 'debian', 'hf:NAME' nor an existing folder (DIR/<lang>/*.txt)"
        )
    langs = sorted(d.name for d in root.iterdir() if d.is_dir() and any(d.glob("*.txt")))
    if not langs:
        raise MoeLitError(f"--source {root}: no language folders with *.txt files (expected DIR/<lang>/*.txt)")
    return langs


def local_paragraphs(root: Path, lang: str) -> Iterator[Paragraph]:
    """Paragraphs of ``root/<lang>/*.txt`` (sorted by file name), split at blank lines."""
    for path in sorted((root / lang).glob("*.txt")):
        doc = path.name
        for pos, block in enumerate(_blank_line_blocks(path.read_text(encoding="utf-8"))):
            yield Paragraph(f"{doc}#{pos}", doc, pos, block)


def _blank_line_blocks(text: str) -> Iterator[str]:
    block: list[str] = []
    for line in text.splitlines():
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets (only when the hub is reachable)
# ---------------------------------------------------------------------------------------------


def hf_paragraphs(name: str, lang: str) -> Iterator[Paragraph]:
    """Paragraphs of the ``text`` column of ``load_dataset(name, lang, split='train')``, streamed."""
    try:
        import datasets
    except ImportError as exc:
        raise MoeLitError(f"--source hf:{name} needs the 'datasets' package (pip install datasets)") from exc
    try:
        rows = datasets.load_dataset(name, lang, split="train", streaming=True)
        for index, row in enumerate(rows):
            if "text" not in row:
                raise MoeLitError(f"--source hf:{name}: rows have no 'text' column (columns: {sorted(row)})")
            doc = str(row.get("id", index))
            for pos, block in enumerate(_blank_line_blocks(row["text"])):
                yield Paragraph(f"{doc}#{pos}", doc, pos, block)
    except (ConnectionError, OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MoeLitError(
            f"--source hf:{name}: cannot load language config {lang!r} ({first_line}); "
            f"offline or unknown dataset? {LOCAL_FOLDER_HINT}"
        ) from exc
