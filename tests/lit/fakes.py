"""A tiny stand-in for MoEDataModule over seeded random tokens (same interface, no files).

Shape legend: B batch, L sequence; every sample is L+1 tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class SeededTokens(Dataset):
    """Sample ``i`` is a fixed random sequence; each "language" draws from its own half of the vocabulary."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int, language: int) -> None:
        self.vocab_size, self.seq_len, self.num_samples, self.seed, self.language = (
            vocab_size,
            seq_len,
            num_samples,
            seed,
            language,
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        half = self.vocab_size // 2
        offset = self.language * half if self.language >= 0 else 0
        return torch.randint(0, half, (self.seq_len + 1,), generator=gen) + offset


class ResumableSampler(Sampler[int]):
    """Sequential indices from ``start``; ``position`` counts the indices handed out so far."""

    def __init__(self, num_samples: int, start: int = 0) -> None:
        self.num_samples, self.position = num_samples, start

    def __len__(self) -> int:
        return self.num_samples - self.position

    def __iter__(self) -> Iterator[int]:
        while self.position < self.num_samples:
            self.position += 1
            yield self.position - 1


class RandomTokenDataModule(pl.LightningDataModule):
    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 16,
        batch_size: int = 4,
        val_batches: int = 2,
        num_samples: int = 10_000,
        seed: int = 0,
        languages: tuple[str, ...] = ("aa", "bb"),
    ) -> None:
        super().__init__()
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.val_batches, self.num_samples, self.seed = val_batches, num_samples, seed
        self.languages = list(languages)
        self._position = 0
        self._sampler: ResumableSampler | None = None

    def train_dataloader(self) -> DataLoader:
        self._sampler = ResumableSampler(self.num_samples, self._position)
        data = SeededTokens(self.vocab_size, self.seq_len, self.num_samples, self.seed, language=-1)
        return DataLoader(data, batch_size=self.batch_size, sampler=self._sampler)

    def _eval_loaders(self, seed: int) -> list[DataLoader]:
        n = self.val_batches * self.batch_size
        return [
            DataLoader(SeededTokens(self.vocab_size, self.seq_len, n, seed, language=i), batch_size=self.batch_size)
            for i in range(len(self.languages))
        ]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.seed + 1)

    def test_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(self.seed + 2)

    def state_dict(self) -> dict:
        return {"position": self._sampler.position if self._sampler is not None else self._position}

    def load_state_dict(self, state: dict) -> None:
        self._position = state["position"]


class SignalAt(pl.Callback):
    """Sends ``signum`` (default SIGINT, a Ctrl-C) to this process at the start of optimizer step
    ``step + 1``, once: usable as ``--trainer.callbacks`` in a ``moe-lit fit`` run in the test's process."""

    def __init__(self, step: int, signum: int = 2) -> None:
        self.step, self.signum, self.sent = step, signum, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import os

        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)
