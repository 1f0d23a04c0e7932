"""Buffers as row sources: what ``buffer.row_source()`` returns.

:class:`BufferRows` (any stored buffer, a :class:`~trajstore.sampling.source.RowSource`) and
:class:`TrajectoryRows` (a trajectory buffer, an :class:`~trajstore.sampling.source.EpisodeSource`)
adapt a buffer's private state to the protocols that samplers, sequence windows, dask arrays
and the torch datasets read through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from trajstore.errors import BadArgumentError
from trajstore.storage.fields.base import Field
from trajstore.storage.head import Head

if TYPE_CHECKING:
    from trajstore.buffers.base import StoredBuffer
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["BufferRows", "TrajectoryRows"]


class BufferRows:
    """A :class:`StoredBuffer` as a :class:`~trajstore.sampling.source.RowSource`: its table's
    rows, every leaf of its space (``buffer.row_source()``).

    Beyond the protocol, ``table`` is the buffer's :class:`~trajstore.core.table.Table`, for the
    done-flag helpers of :mod:`trajstore.core.episodes` (a ReplayBuffer's episodes).
    """

    def __init__(self, buf: StoredBuffer) -> None:
        self.buffer = buf
        self.table = buf._table
        self.name = buf.cache_path or "in-memory buffer"
        self.last_read: Head | None = None

    @property
    def count(self) -> int:
        return self.table.count

    @property
    def start(self) -> int:
        return self.table.state.start

    @property
    def capacity(self) -> int | None:
        return self.table.capacity

    @property
    def live(self) -> bool:
        store = self.buffer._store
        return not store.writable or store.multiprocessing

    @property
    def record(self) -> Head:
        return self.buffer._store.committed

    @property
    def committed(self) -> tuple[int, int]:
        st = self.buffer._store.committed.tables[self.table.name]
        return st.start, st.end

    @property
    def reopen(self) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        buf = self.buffer
        if buf.cache_path is None:
            return None
        return (_reopen_rows, (type(buf), buf.cache_path, buf.storage_options))

    def sync(self) -> None:
        self.buffer._sync()

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        buf = self.buffer
        outer, buf._pinned = buf._pinned, True  # re-entrant: a read inside a read stays pinned
        try:
            yield
        finally:
            buf._pinned = outer

    def refresh(self) -> bool:
        return self.buffer._store.refresh()

    def rows_intact(self, before: Head) -> bool:
        return self.buffer._store.rows_intact(before)

    def read_rows(self, rows: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.buffer._read_rows(rows, leaves)

    def gather_windows(self, first: np.ndarray, length: int, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.table.gather_windows(first, length, [self._field_index(j) for j in leaves])

    def leaf_field(self, leaf: int) -> Field | None:
        return self.table.fields[leaf]

    def _field_index(self, leaf: int) -> int:
        return leaf


def _reopen_rows(cls: Any, path: str, storage_options: dict[str, Any] | None) -> BufferRows:
    """The rows of the store at ``path``, opened read-only in this process (dask workers)."""
    # cls: a StoredBuffer subclass (ReplayBuffer, TrajectoryReplayBuffer): its load_from
    return cls.load_from(path, read_only=True, storage_options=storage_options).row_source()


class TrajectoryRows(BufferRows):
    """A :class:`TrajectoryReplayBuffer` as an :class:`~trajstore.sampling.source.EpisodeSource`:
    its step rows; leaves numbered as the buffer's space (``step_data`` then ``episode_data``)."""

    buffer: TrajectoryReplayBuffer

    def __init__(self, buf: TrajectoryReplayBuffer) -> None:
        super().__init__(buf)
        self.step_leaves = [j for j, s in enumerate(buf._src) if s[0] == "s"]
        self.episode_leaves = [j for j, s in enumerate(buf._src) if s[0] == "e"]

    @property
    def current_episode_id(self) -> int:
        return self.buffer.current_episode_id

    def _field_index(self, leaf: int) -> int:
        kind, f = self.buffer._src[leaf]
        if kind != "s":
            raise BadArgumentError(f"leaf {leaf} is episode data, stored once per episode, not per step row")
        return f

    def leaf_field(self, leaf: int) -> Field | None:
        kind, f = self.buffer._src[leaf]
        return self.table.fields[f] if kind == "s" else None

    def step_ids(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.buffer._step_ids(rows), dtype=np.int64)

    def window_ids(self, first: np.ndarray, length: int) -> np.ndarray:
        return self.table.gather_windows(first, length, [self.buffer._id_field])[0]

    def one_run(self, first: np.ndarray, span: int) -> np.ndarray:
        return self.buffer._runs.one_run(first + self.start, span)

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.buffer._runs.runs()

    def read_episode_rows(self, anchors: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.buffer._read_rows(anchors, leaves)
