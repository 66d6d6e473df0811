"""``MoEDataModule``: litdata token streams of a prepared directory, languages mixed by weight.

Tensor legend: B batch size, L ``seq_len``; a batch is a LongTensor of shape (B, L + 1), whose
``[:, :-1]`` are the inputs and ``[:, 1:]`` the targets.

Training draws each sample from one language, chosen at random with the mixing weights (litdata
``CombinedStreamingDataset`` in a :class:`~moe_lit.data.mixture.MixtureLoader`, a litdata
``StreamingDataLoader`` with a known number of full batches per epoch). Its position is the
datamodule's state, so a run resumed from a checkpoint continues with the next batch instead of
starting the epoch over. Validation and test give one loader per language, in ``languages``
order, over the fixed (unshuffled) blocks of that split, so every evaluation sees the same tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from jsonargparse.typing import path_type
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Subset

from moe_lit.config import refuse_unknown_keys
from moe_lit.data.layout import SPLITS, default_data_dir, import_litdata, read_meta, tokenizer_file, tokens_dir
from moe_lit.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from moe_lit.errors import MoeLitError

if TYPE_CHECKING:
    from moe_lit.lit.run_config import DataConfig

TRAIN_LOADER_KEY = "train_loader"
TOKENIZER_KEY = "tokenizer_sha256"
"""Key of the tokenizer's fingerprint in the datamodule's checkpointed state (a resume compares it)."""
ConfigRelativePath = path_type("")
"""A path jsonargparse resolves (no existence check): a relative one in a config file against that
file's directory, on the command line against the working directory (docs/training.md, Paths)."""


def collate_tokens(blocks: list[np.ndarray]) -> torch.Tensor:
    """Stack token blocks of length L + 1 (numpy int32, as stored) into a LongTensor (B, L + 1)."""
    return torch.as_tensor(np.stack(blocks), dtype=torch.long)


class MoEDataModule(LightningDataModule):
    """Multilingual token streams prepared by ``moe-lit data prepare``."""

    def __init__(
        self,
        data_dir: ConfigRelativePath | str | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        num_workers: int = 0,
        language_weights: dict[str, float] | None = None,
        languages: list[str] | None = None,
        val_batches: int | None = None,
        seed: int = 42,
    ) -> None:
        """
        Args:
            data_dir: A directory written by ``moe-lit data prepare`` (holds ``meta.json``,
                ``tokenizer.json`` and one litdata dataset per split and language). Relative:
                in a config file, to that file's directory; on the command line, to the cwd.
                Default: the data pipeline's (``$MOE_LIT_DATA``, else ``data_cache/default`` of the
                checkout when moe_lit runs from one, else of the cwd), never inside site-packages.
            seq_len: Tokens per training sequence; batches hold ``seq_len + 1`` tokens per row
                (inputs ``[:, :-1]``, targets ``[:, 1:]``).
            batch_size: Sequences per batch (per device).
            num_workers: Worker processes of each validation / test loader (0: main process). The
                training stream is always read in the main process (memory-mapped token blocks),
                which keeps its resume exact.
            language_weights: Relative sampling weight of each language in training, e.g.
                ``{"en": 2, "de": 1}``; languages left out get weight 0 (validated, not trained
                on). Default: proportional to each language's training tokens.
            languages: Languages to use, a subset of the prepared ones (default: all of them).
            val_batches: Batches per language in each validation run (default: the whole split).
            seed: Seed of the shuffling and of the language sampling.
        """
        super().__init__()
        # NOTE: a plain str in the hyper-parameters (absolute when from the CLI or the default).
        data_dir = os.fspath(data_dir) if data_dir is not None else os.path.abspath(default_data_dir())
        self.save_hyperparameters()
        meta = read_meta(data_dir)
        _require_int(seq_len, "seq_len", 1)
        _require_int(batch_size, "batch_size", 1)
        _require_int(num_workers, "num_workers", 0)
        if val_batches is not None:
            _require_int(val_batches, "val_batches", 1)
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_batches = val_batches
        self.seed = seed
        self.languages: list[str] = _select_languages(languages, meta["languages"])
        self.tokenizer_path = tokenizer_file(self.data_dir)
        self.vocab_size: int = load_tokenizer(self.tokenizer_path, meta["vocab_size"]).get_vocab_size()
        self.tokenizer_sha256 = tokenizer_fingerprint(self.tokenizer_path)
        self.tokens: dict[str, dict[str, int]] = meta["tokens"]
        self._check_block_fits()
        self.mixture: dict[str, float] = _mixture(language_weights, self.languages, self.tokens["train"])
        """Probability of each trained language (weight > 0) in the training stream."""
        self._train_loader = None
        self._train_state: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, data: DataConfig, seed: int) -> MoEDataModule:
        """The data module of a run's ``data`` section (``RunConfig.data``) and seed."""
        return cls(
            data.resolved_dir(),
            seq_len=data.seq_len,
            batch_size=data.batch_size,
            num_workers=data.num_workers,
            language_weights=data.language_weights,
            languages=data.languages,
            val_batches=data.val_batches,
            seed=seed,
        )

    def _check_block_fits(self) -> None:
        for split in SPLITS:
            for lang in self.languages:
                if self.tokens[split][lang] < self.seq_len + 1:
                    raise MoeLitError(
                        f"seq_len {self.seq_len}: the {split} split of {lang!r} has only "
                        f"{self.tokens[split][lang]} tokens; lower seq_len or prepare more data"
                    )

    def _dataset(self, split: str, lang: str, shuffle: bool):
        litdata = import_litdata()
        return litdata.StreamingDataset(
            str(tokens_dir(self.data_dir, split, lang)),
            item_loader=litdata.TokensLoader(block_size=self.seq_len + 1),
            shuffle=shuffle,
            drop_last=shuffle,
            seed=self.seed,
        )

    def train_dataloader(self):
        """``len()`` full batches (B, L + 1) per epoch, languages drawn with the ``mixture`` probabilities."""
        from moe_lit.data.mixture import MixtureLoader

        langs = list(self.mixture)
        loader = MixtureLoader(
            [self._dataset("train", lang, shuffle=True) for lang in langs],
            weights=[self.mixture[lang] for lang in langs],
            batch_size=self.batch_size,
            seed=self.seed,
            collate_fn=collate_tokens,
        )
        if len(loader) == 0:
            raise MoeLitError(
                f"batch_size {self.batch_size} x seq_len {self.seq_len}: the training mix has no full batch; "
                "lower them or prepare more data"
            )
        if self._train_state is not None:
            loader.load_state_dict(self._train_state)
            self._train_state = None
        self._train_loader = loader
        return loader

    def _eval_loaders(self, split: str, max_batches: int | None) -> list[DataLoader]:
        loaders = []
        for lang in self.languages:
            dataset = self._dataset(split, lang, shuffle=False)
            size = len(dataset) if max_batches is None else min(len(dataset), max_batches * self.batch_size)
            loaders.append(
                DataLoader(
                    Subset(dataset, range(size)),
                    batch_size=self.batch_size,
                    num_workers=self.num_workers,
                    collate_fn=collate_tokens,
                )
            )
        return loaders

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per language (``languages`` order), at most ``val_batches`` batches each."""
        return self._eval_loaders("val", self.val_batches)

    def test_dataloader(self) -> list[DataLoader]:
        """One loader per language (``languages`` order) over the whole (parallel) test split."""
        return self._eval_loaders("test", None)

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position (what ``load_state_dict`` needs to resume) and the
        tokenizer's fingerprint (what a resume checks)."""
        state: dict[str, Any] = {TOKENIZER_KEY: self.tokenizer_sha256}
        if self._train_loader is not None:
            state[TRAIN_LOADER_KEY] = self._train_loader.state_dict()
        elif self._train_state is not None:
            state[TRAIN_LOADER_KEY] = self._train_state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training stream where ``state_dict`` was taken."""
        state = state_dict.get(TRAIN_LOADER_KEY)
        if state is None:
            return
        if self._train_loader is not None:
            self._train_loader.load_state_dict(state)
        else:
            self._train_state = state


def calibration_batches(data_dir, cfg, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """The training stream of the prepared ``data_dir`` at the model's (``cfg``'s) sequence length:
    the calibration and DOT-MoE batches of :func:`moe_lit.convert.recipes.partition_dense`."""
    datamodule = MoEDataModule(str(data_dir), seq_len=cfg.seq_len, batch_size=batch_size, seed=seed)
    if datamodule.vocab_size != cfg.vocab_size:
        raise MoeLitError(
            f"--calibration: its tokenizer has {datamodule.vocab_size} tokens, the model {cfg.vocab_size}; "
            "prepare the data with the model's tokenizer"
        )
    return iter(datamodule.train_dataloader())


def _require_int(value: Any, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MoeLitError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def _select_languages(languages: list[str] | None, prepared: list[str]) -> list[str]:
    if languages is None:
        return list(prepared)
    unknown = [lang for lang in languages if lang not in prepared]
    if unknown or not languages:
        raise MoeLitError(f"languages: {unknown or '[]'} not prepared; available: {', '.join(prepared)}")
    return list(languages)


def _mixture(weights: dict[str, float] | None, languages: list[str], train_tokens: dict[str, int]) -> dict[str, float]:
    """Normalised sampling probabilities of the languages with a positive weight."""
    if weights is None:
        weights = {lang: float(train_tokens[lang]) for lang in languages}
    refuse_unknown_keys(weights, languages, "language_weights", what="language(s)", label="allowed")
    bad = {lang: w for lang, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)}
    if bad or sum(weights.values()) <= 0:
        raise MoeLitError(f"language_weights: need finite weights >= 0 with a positive sum, got {weights}")
    total = float(sum(weights.values()))
    return {lang: weights[lang] / total for lang in languages if weights.get(lang, 0) > 0}
