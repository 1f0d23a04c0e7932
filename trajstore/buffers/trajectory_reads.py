"""Reads of a ``TrajectoryReplayBuffer``: steps with their episodes' data (``get_at``,
``get_at_with_metadata``, ``sample``), on top of :class:`~trajstore.buffers.base.StoredBuffer`'s
indexing, consistency and backend.  Leaf ``j`` of ``single_space`` is read from the step table or
from the episode table (``layout.sources``); episode rows are found through the episode index.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from trajstore.buffers.base import StoredBuffer
from trajstore.buffers.trajectory_layout import TrajectoryData, TrajectoryLayout, TrajectoryOutput, as_trajectory_data
from trajstore.core.episodes import EpisodeIndex
from trajstore.core.ring import IndexLike, normalize_index

__all__ = ["TrajectoryData", "TrajectoryReads"]


class TrajectoryReads(StoredBuffer):
    """The reads of ``TrajectoryReplayBuffer`` (its base: the constructor there sets the fields below)."""

    #: Set by the constructor (see :mod:`trajstore.buffers.trajectory_layout`).
    layout: TrajectoryLayout
    episode_index: EpisodeIndex
    output: TrajectoryOutput

    def _read_rows(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        return self.layout.read_rows(self.episode_index, idx, leaf_ids)

    def get_at(self, idx: IndexLike) -> TrajectoryData:
        """Steps at ``idx``, with the episode data of their episodes.

        Parameters
        ----------
        idx : int, slice, ``...``, (B,) int array or (len,) bool mask
            Logical step rows, oldest first; negative ints count from the end.

        Returns
        -------
        TrajectoryData
            ``step_data``: one value of ``step_space`` for an int, else a batch with leading axis
            B.  ``episode_data``: the data of each step's episode, batched the same way (zeros
            for an episode without data yet), or None when the buffer has no episode space.

        Raises
        ------
        IndexOutOfRangeError, BadIndexError
            ``idx`` is out of range or not an index.
        ClosedError
            The buffer was closed.
        ConcurrentWriteError
            A reader: the writer kept rewriting or evicting the rows being read.
        """
        return as_trajectory_data(super().get_at(idx))

    def get_at_with_metadata(self, idx: IndexLike) -> tuple[TrajectoryData, dict[str, Any]]:
        """``(get_at(idx), {"episode_ids": ids})`` with ids of shape () or (B,), int64."""

        def read() -> tuple[list[np.ndarray], Any]:
            self._sync()
            i = idx if isinstance(idx, slice) else normalize_index(idx, self._table.count)
            rows = np.arange(*i.indices(self._table.count)) if isinstance(i, slice) else i
            return self._read(rows, self._all_leaves), self.layout.step_ids(rows)

        arrays, ids = self._consistent(read)  # the rows and their ids from one commit record
        out = self._backend.out
        return as_trajectory_data(self._plan.from_arrays([out(a) for a in arrays])), {"episode_ids": out(np.asarray(ids))}

    def sample(self, batch_size: int, *, rng: np.random.Generator | int | None = None) -> TrajectoryData:
        """``batch_size`` steps drawn uniformly with replacement, with their episodes' data.

        Parameters
        ----------
        batch_size : int
            Steps drawn (B).
        rng : numpy.random.Generator or int, optional
            Generator, or a seed for a new one; by default the buffer's own.

        Returns
        -------
        TrajectoryData
            ``step_data`` leaves of shape (B, ...); ``episode_data`` of each step's episode,
            (B, ...) (zeros where an episode has no data yet), or None without an episode space.

        Raises
        ------
        EmptyBufferError
            The buffer holds no steps (or a writer emptied it meanwhile).
        ConcurrentWriteError
            A reader: the writer evicts steps faster than this reader can sample them.
        ClosedError
            The buffer was closed.
        """
        return as_trajectory_data(super().sample(batch_size, rng=rng))
