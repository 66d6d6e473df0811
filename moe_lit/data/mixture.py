"""The weighted language mix as a litdata ``StreamingDataLoader`` with a known epoch length.

litdata's ``CombinedStreamingDataset`` draws the language of every sample with ``random.Random(seed)``
(restarted each epoch) and ends the epoch when a drawn language has no block left. Without a
length, Lightning fetches one batch ahead, so a checkpoint records one batch more than was trained
on and a resumed run skips it; with a length there is no look-ahead. :func:`epoch_samples` replays
those draws to count the samples of an epoch; :class:`MixtureLoader` yields that many full batches
and remembers how many it has yielded, so resuming continues with the very next batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from moe_lit.data.layout import import_litdata

litdata = import_litdata()
BATCHES_KEY = "batches_in_epoch"


def epoch_samples(weights: Sequence[float], sizes: Sequence[int], seed: int) -> int:
    """Samples before the first language runs out, replaying litdata's weighted draws."""
    total = sum(weights)
    probs = [w / total for w in weights]  # NOTE: normalised exactly as litdata does
    indexes = list(range(len(sizes)))
    rng = random.Random(seed)
    drawn = [0] * len(sizes)
    samples = 0
    while True:
        (index,) = rng.choices(indexes, weights=probs, k=1)
        if drawn[index] == sizes[index]:
            return samples
        drawn[index] += 1
        samples += 1


class MixtureLoader(litdata.StreamingDataLoader):
    """Full batches of the weighted language mix, ``len()`` of them per epoch, resumable to the batch."""

    def __init__(
        self, datasets: list, weights: Sequence[float], batch_size: int, seed: int, collate_fn: Callable
    ) -> None:
        """``datasets``: litdata StreamingDatasets, one per language, drawn with ``weights``."""
        combined = litdata.CombinedStreamingDataset(datasets, seed=seed, weights=weights, iterate_over_all=False)
        # NOTE: main process only: with workers, litdata splits each language's consumed count
        # evenly over the workers when it restores, which a random mix does not do.
        super().__init__(combined, batch_size=batch_size, num_workers=0, collate_fn=collate_fn)
        self.batches_per_epoch = epoch_samples(weights, [len(d) for d in datasets], seed) // batch_size
        self._batches = 0
        self._resume_from: int | None = None

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        resume_from, self._resume_from = self._resume_from, None
        # NOTE: litdata keeps `restore` set after an epoch that was not run to its end; here it
        # holds exactly when load_state_dict() came after the last iteration started.
        self.restore = resume_from is not None
        self._batches = resume_from or 0
        stream = super().__iter__()
        for batch in stream:
            self._batches += 1
            if self._batches == self.batches_per_epoch:
                for _ in stream:  # the partial tail: drop it so that litdata closes its epoch
                    pass
            yield batch
            if self._batches == self.batches_per_epoch:
                return

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), BATCHES_KEY: self._batches}

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        if obj[BATCHES_KEY] >= self.batches_per_epoch:
            # a finished epoch: the next iteration starts the following epoch afresh
            self.current_epoch = obj["current_epoch"]
            self._resume_from = None
            return
        super().load_state_dict(obj)
        self._resume_from = obj[BATCHES_KEY]
