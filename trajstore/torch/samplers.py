"""Batch samplers for training loops that draw a fixed number of random batches."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from trajstore.errors import BadOptionError, EmptyBufferError, ResumeStateError
from trajstore.torch.resume import ResumableOrder

__all__ = ["RandomBatchSampler"]


class RandomBatchSampler(ResumableOrder, Sampler[list[int]]):
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

    ``state_dict(consumed=k)`` / ``load_state_dict`` resume an epoch after its ``k``-th batch in
    any process (``trajstore.torch.resume``).  A sampler built on a store that grew since resumes
    the saved epoch over the rows it had then; the new rows join at the next epoch.
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
        self._resumed_n: tuple[int, int] | None = None  # (epoch, rows) of a resumed epoch

    def fingerprint(self) -> dict[str, Any]:
        """Batch size, count and replacement (the rows are checked by :meth:`load_state_dict`)."""
        return {"batch_size": self.batch_size, "num_batches": self.num_batches, "replacement": self.replacement}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The position (see ``trajstore.torch.resume``) and the rows of the epoch in progress."""
        state = super().state_dict(consumed)
        state["rows"] = self._rows(self.epoch)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume ``state``'s epoch (over its rows: a store that grew adds rows from the next epoch)."""
        rows = state.get("rows")
        if not isinstance(rows, int) or not 1 <= rows <= self.n:
            raise ResumeStateError(f"the saved sampler state is not this sampler's: rows: saved {rows!r}, this "
                                   f"dataset has {self.n} (a resumed epoch needs the rows it had, or more)")
        super().load_state_dict(state)
        self._resumed_n = (self.epoch, rows)

    def _rows(self, epoch: int) -> int:
        return self._resumed_n[1] if self._resumed_n is not None and self._resumed_n[0] == epoch else int(self.n)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: the batches that follow depend on ``(seed, epoch, rank)``
        (call it every epoch, as with ``DistributedSampler``, for fresh batches)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch, self.rank])
        n = self._rows(self.epoch)
        start, drawn = self._take_start(), 0
        while self.num_batches is None or drawn < self.num_batches:
            if self.replacement:
                idx = rng.integers(0, n, size=self.batch_size)
            else:
                idx = rng.choice(n, size=self.batch_size, replace=False)
            drawn += 1
            if drawn > start:  # a resumed epoch draws (and drops) the batches it already gave
                self._advance()
                yield idx.tolist()

    def __len__(self) -> int:
        if self.num_batches is None:
            raise TypeError("an endless RandomBatchSampler (num_batches=None) has no length")
        return self.num_batches
