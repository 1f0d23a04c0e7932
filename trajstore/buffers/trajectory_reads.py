"""Reads of a ``TrajectoryReplayBuffer``: steps with their episodes' data (``get_at``,
``get_at_with_metadata``, ``sample``), on top of :class:`~trajstore.buffers.base.StoredBuffer`'s
indexing, consistency and backend.  Leaf ``j`` of ``single_space`` is read from the step table or
from the episode table (``_src``); episode rows are found through the episode index.
"""

from __future__ import annotations

from typing import Any, Sequence, TypedDict

import numpy as np

from trajstore.buffers.base import StoredBuffer
from trajstore.core.episodes import EpisodeIndex
from trajstore.core.ring import IndexLike, normalize_index
from trajstore.core.table import Table
from trajstore.spaces import ValuePlan

__all__ = ["TrajectoryData", "TrajectoryReads"]


class TrajectoryData(TypedDict):
    """What a trajectory buffer read returns."""

    step_data: Any
    episode_data: Any | None


class TrajectoryReads(StoredBuffer):
    """The reads of ``TrajectoryReplayBuffer`` (its base: the constructor there sets the fields below)."""

    _table: Table
    _ep_table: Table | None
    _ep_plan: ValuePlan | None
    _id_field: int
    #: Leaf j of ``single_space`` -> ("s", step field) or ("e", episode field).
    _src: list[tuple[str, int]]
    _episodes: EpisodeIndex

    def _step_ids(self, idx: int | np.ndarray) -> Any:
        if isinstance(idx, int):
            return self._table.read_row(idx, [self._id_field])[0]
        return self._table.gather(idx, [self._id_field])[0]

    def _read_rows(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        step_f = [self._src[j][1] for j in leaf_ids if self._src[j][0] == "s"]
        ep_f = [self._src[j][1] for j in leaf_ids if self._src[j][0] == "e"]
        single = isinstance(idx, int)
        steps = ((self._table.read_row(idx, step_f) if isinstance(idx, int) else self._table.gather(idx, step_f))
                 if step_f else [])
        eps: list[np.ndarray] = []
        if ep_f:
            eps = self._episode_rows(np.atleast_1d(self._step_ids(idx)), ep_f)
            if single:
                eps = [e[0] for e in eps]
        it_s, it_e = iter(steps), iter(eps)
        return [next(it_s) if self._src[j][0] == "s" else next(it_e) for j in leaf_ids]

    def _episode_rows(self, ids: np.ndarray, fields: list[int]) -> list[np.ndarray]:
        """Episode data of ``ids`` (zeros where an episode has none)."""
        assert self._ep_table is not None and self._ep_plan is not None
        rows = self._episodes.lookup(ids)
        have = rows >= 0
        got = self._ep_table.gather(rows[have], fields) if have.any() else None
        out = []
        for k, f in enumerate(fields):
            leaf = self._ep_plan.leaves[f]
            arr = np.zeros((len(ids), *leaf.shape), leaf.dtype)
            if got is not None:
                arr[have] = got[k]
            out.append(arr)
        return out

    def _wrap(self, data: dict[str, Any]) -> TrajectoryData:
        return TrajectoryData(step_data=data["step_data"], episode_data=data.get("episode_data"))

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
        return self._wrap(super().get_at(idx))

    def get_at_with_metadata(self, idx: IndexLike) -> tuple[TrajectoryData, dict[str, Any]]:
        """``(get_at(idx), {"episode_ids": ids})`` with ids of shape () or (B,), int64."""

        def read() -> tuple[list[np.ndarray], Any]:
            self._sync()
            i = idx if isinstance(idx, slice) else normalize_index(idx, self._table.count)
            rows = np.arange(*i.indices(self._table.count)) if isinstance(i, slice) else i
            return self._read(rows, self._all_leaves), self._step_ids(rows)

        arrays, ids = self._consistent(read)  # the rows and their ids from one commit record
        out = self._backend.out
        return self._wrap(self._plan.from_arrays([out(a) for a in arrays])), {"episode_ids": out(np.asarray(ids))}

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
        return self._wrap(super().sample(batch_size, rng=rng))
