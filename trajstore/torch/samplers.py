"""Batch samplers for training loops that draw a fixed number of random batches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from trajstore.errors import BadOptionError, EmptyBufferError

__all__ = ["RandomBatchSampler"]


class RandomBatchSampler(Sampler[list[int]]):
    """Endless (or ``num_batches`` long) stream of uniformly random index batches.

    Use it as a DataLoader's ``batch_sampler``: each batch is read with one ``__getitems__``
    call.  ``num_batches=None`` never ends (take what you need, e.g. with ``itertools.islice``
    or ``zip(range(steps), loader)``); an int makes ``len(sampler) == num_batches`` per epoch.

    Parameters
    ----------
    data_source : sized or int
        The dataset (or its length).
    batch_size : int
    num_batches : int, optional
    replacement : bool
        True (default): every index drawn independently, as ``buffer.sample``; False: each
        batch has distinct indices (``batch_size <= len``).
    seed : int, optional
        Batches depend only on ``(seed, epoch, rank)``; ``None`` draws a fresh seed.
    rank, num_replicas : int
        Under DistributedDataParallel give each rank its own stream.
    """

    def __init__(self, data_source: Any, batch_size: int, num_batches: int | None = None, *,
                 replacement: bool = True, seed: int | None = None, rank: int = 0, num_replicas: int = 1) -> None:
        self.n = data_source if isinstance(data_source, (int, np.integer)) else len(data_source)
        if self.n < 1:
            raise EmptyBufferError("cannot sample batches from an empty dataset")
        if batch_size < 1 or (num_batches is not None and num_batches < 0):
            raise BadOptionError(f"batch_size must be >= 1 and num_batches >= 0; got {batch_size}, {num_batches}")
        if not replacement and batch_size > self.n:
            raise BadOptionError(f"batch_size {batch_size} > {self.n} items without replacement")
        if not 0 <= rank < num_replicas:
            raise BadOptionError(f"rank {rank} not in [0, {num_replicas})")
        self.batch_size, self.num_batches, self.replacement = int(batch_size), num_batches, replacement
        self.seed = int(np.random.SeedSequence().entropy % (2**63)) if seed is None else int(seed)  # type: ignore[operator]
        self.rank, self.num_replicas = rank, num_replicas
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: the batches that follow depend on ``(seed, epoch, rank)``
        (call it every epoch, as with ``DistributedSampler``, for fresh batches)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch, self.rank])
        drawn = 0
        while self.num_batches is None or drawn < self.num_batches:
            if self.replacement:
                idx = rng.integers(0, self.n, size=self.batch_size)
            else:
                idx = rng.choice(self.n, size=self.batch_size, replace=False)
            drawn += 1
            yield idx.tolist()

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an endless RandomBatchSampler (num_batches=None) has no length")
        return self.num_batches
