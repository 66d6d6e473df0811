"""``moe-lit data prepare``: corpus → tokenizer → litdata token chunks, one dataset per language and split.

The whole output directory is written to a temporary sibling and renamed into place at the end,
so an interrupted run never leaves a directory that looks prepared (see :mod:`moe_lit.data.layout`
for the layout). Re-running with the same settings reuses the prepared directory; packages and
extracted paragraphs are cached across settings (``$MOE_LIT_CACHE``).
"""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moe_lit.accounting import markdown_table
from moe_lit.config import ConfigError
from moe_lit.data import corpus, debian
from moe_lit.data.corpus import Paragraph
from moe_lit.data.layout import (
    FORMAT_VERSION,
    META_FILE,
    SPLITS,
    default_cache_dir,
    default_data_dir,
    import_litdata,
    read_meta,
    text_file,
    tokenizer_file,
    tokens_dir,
)
from moe_lit.data.tokenizer import DEFAULT_VOCAB_SIZE, EOS, encode_paragraphs, load_tokenizer, train_tokenizer
from moe_lit.errors import MoeLitError
from moe_lit.io import atomic_directory, atomic_write_json, check_output

CHUNK_TOKENS = 2**20
"""Tokens per litdata chunk (4 MiB of int32); a training block never spans two chunks."""
PARAGRAPHS_PER_ITEM = 256
"""Paragraphs tokenized into one litdata item."""
MIN_VOCAB_SIZE = 257
"""256 byte tokens plus EOS."""


@dataclass
class PrepareConfig:
    """What ``moe-lit data prepare`` builds."""

    source: str = "debian"
    """``debian`` (LibreOffice help from Debian packages), a folder ``DIR/<lang>/*.txt`` or ``hf:NAME``."""
    languages: list[str] | None = None
    """Language codes; default: nine languages for ``debian``, every folder for a local source."""
    out: Path | None = None
    """Output directory; default ``$MOE_LIT_DATA`` or ``data_cache/default`` in the checkout."""
    vocab_size: int | None = None
    """BPE vocabulary size (default 8192); must match ``tokenizer`` when one is given."""
    tokenizer: Path | None = None
    """Reuse this ``tokenizer.json`` instead of training one (e.g. to tokenize new data for a model)."""
    max_paragraphs: int | None = None
    """Keep at most this many paragraphs per language (the same ids in every language)."""
    val_fraction: float = 0.05
    """Fraction of paragraph ids in the validation split."""
    test_fraction: float = 0.05
    """Fraction of paragraph ids in the test split (a parallel corpus for a parallel source)."""
    cache_dir: Path | None = None
    """Package / paragraph cache; default ``$MOE_LIT_CACHE`` or ``~/.cache/moe_lit``."""
    force: bool = False
    """Rebuild even when ``out`` was prepared with the same settings; replace an ``out`` that holds
    anything else (refused without it). An ``out`` holding the source or the tokenizer is always refused."""
    progress: bool = True
    """Show progress messages, and progress bars when stderr is a terminal."""

    def __post_init__(self) -> None:
        self.out = Path(self.out) if self.out is not None else default_data_dir()
        self.cache_dir = Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir()
        self.tokenizer = Path(self.tokenizer) if self.tokenizer is not None else None
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < MIN_VOCAB_SIZE):
            raise ConfigError(f"vocab_size: must be an integer >= {MIN_VOCAB_SIZE}, got {self.vocab_size!r}")
        if self.max_paragraphs is not None and self.max_paragraphs < 1:
            raise ConfigError(f"max_paragraphs: must be a positive integer, got {self.max_paragraphs!r}")
        for name in ("val_fraction", "test_fraction"):
            if not 0.0 < getattr(self, name) < 0.5:
                raise ConfigError(f"{name}: must lie in (0, 0.5), got {getattr(self, name)!r}")
        if self.languages is not None and len(set(self.languages)) != len(self.languages):
            raise ConfigError(f"languages: duplicates in {self.languages}")

    def settings(self, languages: list[str]) -> dict[str, object]:
        """Everything that determines the prepared data (compared to reuse a prepared directory)."""
        kind = corpus.source_kind(self.source)
        source = str(Path(self.source).resolve()) if kind == "local" else self.source
        settings = {k: v for k, v in asdict(self).items() if k not in ("out", "cache_dir", "force", "progress")}
        settings.update(source=source, languages=languages)
        settings["tokenizer"] = str(self.tokenizer.resolve()) if self.tokenizer else None
        return settings


# ---------------------------------------------------------------------------------------------
# corpus per language
# ---------------------------------------------------------------------------------------------


def _check_languages(languages: list[str], allowed: list[str], where: str) -> None:
    unknown = [lang for lang in languages if lang not in allowed]
    if unknown:
        raise MoeLitError(
            f"--languages: unknown code(s) {', '.join(unknown)} for {where}; allowed: {' '.join(allowed)}"
        )


def resolve_languages(cfg: PrepareConfig) -> list[str]:
    """The language codes to prepare, checked against what the source offers."""
    kind = corpus.source_kind(cfg.source)
    if kind == "hf":
        if not cfg.languages:
            raise MoeLitError(f"--languages is required with --source {cfg.source} (the dataset's config names)")
        return list(cfg.languages)
    if kind == "local":
        allowed = corpus.local_languages(Path(cfg.source))
        languages = list(cfg.languages or allowed)
        _check_languages(languages, allowed, f"--source {cfg.source}")
        return languages
    debian.check_tools()
    debian.ensure_package_lists()
    languages = list(cfg.languages or debian.DEFAULT_LANGUAGES)
    _check_languages(languages, debian.available_languages(), "--source debian (libreoffice-help-<code> packages)")
    return languages


def _raw_paragraphs(cfg: PrepareConfig, lang: str) -> Iterator[Paragraph]:
    kind = corpus.source_kind(cfg.source)
    if kind == "local":
        return corpus.local_paragraphs(Path(cfg.source), lang)
    # NOTE: a hub dataset may be huge: stream only what the cap keeps.
    return itertools.islice(corpus.hf_paragraphs(cfg.source[len(corpus.HF_PREFIX) :], lang), cfg.max_paragraphs)


def _debian_corpus(cfg: PrepareConfig, languages: list[str]) -> dict[str, list[Paragraph]]:
    from tqdm.auto import tqdm

    fetch = sorted({*languages, debian.REFERENCE_LANGUAGE}, key=lambda lang: lang != debian.REFERENCE_LANGUAGE)
    cached = [lang for lang in fetch if debian.cache_file(lang, cfg.cache_dir).is_file()]
    if cached and cfg.progress:
        print(f"reusing cached packages {' '.join(cached)} from {cfg.cache_dir / 'debian'}", flush=True)
    raw: dict[str, list[Paragraph]] = {}
    # NOTE: disable=None: bars on a terminal only (a log would get the nested bars' cursor-up escapes).
    for lang in tqdm(fetch, desc="download+extract", unit="package", disable=None if cfg.progress else True):
        raw[lang] = debian.cached_paragraphs(lang, cfg.cache_dir, cfg.progress)
    fallback = {par.id: par.text for par in raw[debian.REFERENCE_LANGUAGE]}
    return {
        lang: corpus.clean(raw[lang], None if lang == debian.REFERENCE_LANGUAGE else fallback) for lang in languages
    }


def load_corpus(cfg: PrepareConfig, languages: list[str]) -> dict[str, list[Paragraph]]:
    """Cleaned, capped paragraphs per language, in document order."""
    if corpus.source_kind(cfg.source) == "debian":
        cleaned = _debian_corpus(cfg, languages)
    else:
        cleaned = {lang: corpus.clean(_raw_paragraphs(cfg, lang)) for lang in languages}
    return corpus.cap(cleaned, cfg.max_paragraphs)


# ---------------------------------------------------------------------------------------------
# writing the prepared directory
# ---------------------------------------------------------------------------------------------


def _yield_item(tokens: np.ndarray) -> Iterator[np.ndarray]:
    yield tokens


def write_tokens(tokenizer, paragraphs: list[Paragraph], out_dir: Path) -> int:
    """Tokenize ``paragraphs`` into a litdata token-chunk dataset at ``out_dir``; returns the token count."""
    litdata = import_litdata()
    items = [
        encode_paragraphs(tokenizer, [par.text for par in paragraphs[start : start + PARAGRAPHS_PER_ITEM]])
        for start in range(0, len(paragraphs), PARAGRAPHS_PER_ITEM)
    ]
    # NOTE: litdata's optimize installs a SIGINT handler that exits 0 and never restores it: ours
    # goes back, so a Ctrl-C later in this process (a study, a test session) still interrupts.
    sigint = signal.getsignal(signal.SIGINT)
    try:
        _optimize(litdata, items, out_dir)
    finally:
        signal.signal(signal.SIGINT, sigint)
    return int(sum(item.size for item in items))


def _optimize(litdata, items: list[np.ndarray], out_dir: Path) -> None:
    # NOTE: "fork" because litdata's default "spawn" re-imports torch in the worker on every call;
    # the worker only serializes the arrays tokenized here.
    litdata.optimize(
        fn=_yield_item,
        inputs=items,
        output_dir=str(out_dir),
        chunk_size=CHUNK_TOKENS,
        item_loader=litdata.TokensLoader(),
        num_workers=1,
        start_method="fork",
        reorder_files=False,
        verbose=False,
    )


def _write_texts(root: Path, splits: dict[str, dict[str, list[Paragraph]]]) -> None:
    for split, per_lang in splits.items():
        for lang, paragraphs in per_lang.items():
            path = text_file(root, split, lang)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(par.to_json(), ensure_ascii=False) + "\n" for par in paragraphs)


def _train_tokenizer(cfg: PrepareConfig, splits: dict[str, dict[str, list[Paragraph]]]):
    texts = (par.text for paragraphs in splits["train"].values() for par in paragraphs)
    return train_tokenizer(texts, cfg.vocab_size or DEFAULT_VOCAB_SIZE, cfg.progress)


def _check_nonempty(splits: dict[str, dict[str, list[Paragraph]]]) -> None:
    for split, per_lang in splits.items():
        empty = [lang for lang, paragraphs in per_lang.items() if not paragraphs]
        if empty:
            # NOTE: a larger held-out fraction takes its paragraphs from training: the hint never
            # suggests it for an empty train split.
            fraction = "lower --val-fraction / --test-fraction" if split == "train" else f"raise --{split}-fraction"
            raise MoeLitError(
                f"language(s) {', '.join(empty)}: no paragraphs in the {split} split; the source is too small "
                f"(add text, raise --max-paragraphs, or {fraction})"
            )


def _per_split(splits: dict[str, dict[str, list[Paragraph]]], measure) -> dict[str, dict[str, int]]:
    return {split: {lang: measure(pars) for lang, pars in per_lang.items()} for split, per_lang in splits.items()}


def _parallel_ids(per_lang: dict[str, list[Paragraph]]) -> int:
    id_sets = [{par.id for par in paragraphs} for paragraphs in per_lang.values()]
    return len(set.intersection(*id_sets)) if id_sets else 0


def _prepared_with(out: Path, settings: dict[str, object]) -> dict[str, object] | None:
    """The meta of ``out`` when it was prepared (in this format) with ``settings``, else None."""
    try:
        meta = read_meta(out)
    except MoeLitError:  # not prepared, or by another format version: rebuild
        return None
    return meta if meta.get("settings") == settings else None


def prepare(cfg: PrepareConfig) -> dict[str, object]:
    """Build (or reuse) the prepared directory ``cfg.out``; returns its ``meta.json`` content."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    languages = resolve_languages(cfg)
    settings = cfg.settings(languages)
    meta = None if cfg.force else _prepared_with(cfg.out, settings)
    if meta is not None:
        if cfg.progress:
            print(f"data already prepared at {cfg.out} with these settings: reusing it (--force rebuilds)")
            print(summary(meta, cfg.out))
        return meta
    local_source = cfg.source if Path(cfg.source).is_dir() else None
    check_output(cfg.out, {"--source": local_source, "--tokenizer": cfg.tokenizer}, cfg.force)
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.vocab_size) if cfg.tokenizer is not None else None
    paragraphs = load_corpus(cfg, languages)
    splits = {split: {lang: [] for lang in languages} for split in SPLITS}
    for lang, pars in paragraphs.items():
        for split, chosen in corpus.split_paragraphs(pars, cfg.val_fraction, cfg.test_fraction).items():
            splits[split][lang] = chosen
    _check_nonempty(splits)
    tokenizer = tokenizer or _train_tokenizer(cfg, splits)
    tokens: dict[str, dict[str, int]] = {split: {} for split in SPLITS}
    with atomic_directory(cfg.out) as tmp:
        _write_texts(tmp, splits)
        tokenizer.save(str(tokenizer_file(tmp)))
        jobs = [(split, lang) for split in SPLITS for lang in languages]
        for split, lang in tqdm(jobs, desc="optimize", unit="dataset", disable=None if cfg.progress else True):
            tokens[split][lang] = write_tokens(tokenizer, splits[split][lang], tokens_dir(tmp, split, lang))
        meta = {
            "format": FORMAT_VERSION,
            "source": settings["source"],
            "languages": languages,
            "vocab_size": tokenizer.get_vocab_size(),
            "eos_token": EOS,
            "eos_id": tokenizer.token_to_id(EOS),
            "tokens": tokens,
            "paragraphs": _per_split(splits, len),
            "bytes": _per_split(splits, lambda pars: sum(len(par.text.encode()) for par in pars)),
            "parallel_ids": {split: _parallel_ids(per_lang) for split, per_lang in splits.items()},
            "settings": settings,
            "seconds": round(time.perf_counter() - start, 1),
        }
        atomic_write_json(tmp / META_FILE, meta)
    if cfg.progress:
        print(summary(meta, cfg.out))
    return meta


def language_rows(meta: dict) -> list[dict[str, object]]:
    """One row per language: paragraphs, UTF-8 bytes and tokens over all splits, tokens per split."""
    rows = []
    for lang in meta["languages"]:
        row: dict[str, object] = {"language": lang}
        for key in ("paragraphs", "bytes", "tokens"):
            row[key] = sum(meta[key][split][lang] for split in SPLITS)
        row.update({f"{split} tokens": meta["tokens"][split][lang] for split in SPLITS})
        rows.append(row)
    return rows


def summary(meta: dict, out: Path) -> str:
    """A per-language markdown table and the one-line summary."""
    rows = language_rows(meta)
    total = {key: sum(int(row[key]) for row in rows) for key in ("paragraphs", "bytes", "tokens")}
    line = (
        f"prepared {len(rows)} languages ({' '.join(meta['languages'])}): {total['paragraphs']:,} paragraphs, "
        f"{total['bytes'] / 1e6:.1f} MB, {total['tokens']:,} tokens (vocab {meta['vocab_size']}) "
        f"in {meta['seconds']:.0f} s -> {out}"
    )
    return markdown_table(rows) + "\n" + line
