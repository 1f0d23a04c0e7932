"""Buffers as row sources: what ``buffer.row_source()`` returns.

:class:`BufferRows` (any stored buffer, a :class:`~trajstore.sampling.source.RowSource`),
:class:`TrajectoryRows` (a trajectory buffer, an :class:`~trajstore.sampling.source.EpisodeSource`)
and :class:`SelectionRows` (the steps of some of its episodes: an ``EpisodeView``'s rows) adapt a
buffer's private state to the protocols that samplers, sequence windows, dask arrays and the
torch datasets read through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from trajstore.errors import BadArgumentError
from trajstore.sampling.source import EpisodeSource, rows_after_start
from trajstore.storage.fields.base import Field
from trajstore.storage.head import Head

if TYPE_CHECKING:
    from trajstore.buffers.base import StoredBuffer
    from trajstore.buffers.trajectory import TrajectoryReplayBuffer

__all__ = ["BufferRows", "TrajectoryRows", "SelectionRows", "short_ids"]


class BufferRows:
    """A :class:`StoredBuffer` as a :class:`~trajstore.sampling.source.RowSource`: its table's
    rows, every leaf of its space (``buffer.row_source()``).

    Beyond the protocol, ``table`` is the buffer's :class:`~trajstore.core.table.Table`, for the
    done-flag helpers of :mod:`trajstore.core.episodes` (a ReplayBuffer's episodes).
    """

    def __init__(self, buf: StoredBuffer) -> None:
        self.buffer = buf
        self.store = buf.store  # (a buffer keeps its store: read once, not per sample)
        self._pin = buf.pinned()  # the buffer's one reusable pin
        self.table = buf.rows_table
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
        store = self.store
        return not store.writable or store.multiprocessing

    @property
    def record(self) -> Head:
        return self.store.committed

    @property
    def committed(self) -> tuple[int, int]:
        st = self.store.committed.tables[self.table.name]
        return st.start, st.end

    @property
    def reopen(self) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        buf = self.buffer
        if buf.cache_path is None:
            return None
        return (_reopen_rows, (type(buf), buf.cache_path, buf.storage_options))

    def sync(self) -> None:
        self.buffer.sync_reads()

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        return self._pin

    def refresh(self) -> bool:
        return self.store.refresh()

    def rows_intact(self, before: Head) -> bool:
        return self.store.rows_intact(before)

    def absolute_rows(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64) + self.start

    def logical_rows(self, absolute: np.ndarray, before: Head) -> np.ndarray | None:
        return rows_after_start(self, absolute, before)

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
        self.layout = buf.layout
        self.step_leaves = buf.layout.step_leaves
        self.episode_leaves = buf.layout.episode_leaves

    @property
    def current_episode_id(self) -> int:
        return self.buffer.current_episode_id

    def _field_index(self, leaf: int) -> int:
        kind, f = self.layout.sources[leaf]
        if kind != "s":
            raise BadArgumentError(f"leaf {leaf} is episode data, stored once per episode, not per step row")
        return f

    def leaf_field(self, leaf: int) -> Field | None:
        kind, f = self.layout.sources[leaf]
        return self.table.fields[f] if kind == "s" else None

    def step_ids(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self.layout.step_ids(rows), dtype=np.int64)

    def window_ids(self, first: np.ndarray, length: int) -> np.ndarray:
        return self.table.gather_windows(first, length, [self.layout.id_field])[0]

    def one_run(self, first: np.ndarray, span: int) -> np.ndarray:
        return self.buffer.run_index.one_run(first + self.start, span)

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.buffer.run_index.runs()

    def read_rows(self, rows: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.layout.read_rows(self.buffer.episode_index, rows, leaves)

    def read_episode_rows(self, anchors: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.layout.read_rows(self.buffer.episode_index, anchors, leaves)

    def episode_data_stale(self, rows: np.ndarray, before: Head) -> np.ndarray:
        """(B,) bool: which logical ``rows`` (stored under the current record) may have read their
        episode's data, under record ``before``, from an episode-data slot that was reused since.

        An episode-data ring evicts its oldest rows, then reuses their slots, while the steps of
        those episodes may stay in the step ring.  The rows' step data is then intact but their
        episode data may be another episode's.  When the episode-data ring evicted rows after
        ``before``, the rows whose episode has no data row now are answered True: they may have
        had one then; so are rows whose episode's data row was added after ``before`` (its
        data was evicted and set again).  (Rows whose episode never had one are read again too:
        this happens only while an eviction overlaps a read.)  An epoch change is not looked at:
        ``logical_rows`` already follows no row across it.
        """
        rows = np.asarray(rows, np.int64)
        et = self.layout.episode_table
        if et is None or et.capacity is None or not len(rows):
            return np.zeros(rows.shape, bool)
        then, now = before.tables.get(et.name), self.record.tables.get(et.name)
        if then is None or now is None or now.start <= then.start:
            return np.zeros(rows.shape, bool)
        # No data row now, or one added since (an evicted episode's data set again): not the row read.
        found = self.buffer.episode_index.lookup(self.step_ids(rows))
        return (found < 0) | (et.state.start + found >= then.end)


class SelectionRows(EpisodeSource):
    """The steps of some episodes of a trajectory buffer as an
    :class:`~trajstore.sampling.source.EpisodeSource`.

    Logical row ``i`` of the selection is the ``i``-th step, in the parent's row order, whose
    episode id is selected.  The rows are found from the parent's run index (O(runs)) and found
    again whenever the parent's state changes.  Absolute rows of the selection count the
    selected steps a ring has evicted since the view was made, so the retry loop of
    :func:`~trajstore.sampling.source.sample_consistent` redraws exactly the evicted anchors.
    Episodes are never merged: consecutive selected steps of different ids stay different runs.
    """

    def __init__(self, parent: TrajectoryRows, ids: np.ndarray) -> None:
        self.parent = parent
        self.ids = ids
        self.name = f"{parent.name} (episodes {short_ids(ids)})"
        self.last_read: Head | None = None
        self.step_leaves = parent.step_leaves
        self.episode_leaves = parent.episode_leaves
        self._key: tuple[int, int, int] | None = None
        self._abs = np.zeros(0, np.int64)  # parent absolute rows of the selected steps, increasing
        self._vstart = 0  # absolute row (of the selection) of logical row 0
        self._runs = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))

    # -- the selection -------------------------------------------------------------------------
    def _resolve(self) -> np.ndarray:
        """Parent absolute rows of the selected steps under the parent's current state."""
        p = self.parent
        st = p.table.state
        key = (p.record.epoch, st.start, st.end)
        if key != self._key:
            first, lengths, ids = p.runs()
            mine = np.isin(ids, self.ids)
            f, n, i = first[mine], lengths[mine], ids[mine]
            total = int(n.sum())
            # Logical parent rows of every selected run, concatenated in row order.
            offs = np.repeat(f - np.concatenate([[0], np.cumsum(n)[:-1]]), n) if total else np.zeros(0, np.int64)
            rows = (np.arange(total, dtype=np.int64) + offs).astype(np.int64) + p.start
            if self._key is not None and self._key[0] == key[0]:
                # Same epoch: only appends and evictions; evicted selected rows leave the front.
                self._vstart += int(np.searchsorted(self._abs, p.start))
                if len(self._abs):
                    # A reader's start that moved back (after an eviction record): rows before the
                    # old first one rejoin the selection in front.
                    self._vstart -= int(np.searchsorted(rows, self._abs[0]))
            else:
                self._vstart = 0
            self._abs, self._key = rows, key
            # The selection's runs (a parent run of equal ids stays one run; neighbours of equal
            # id, split in the parent by unselected steps, join).
            vfirst = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64) if total else np.zeros(0, np.int64)
            if len(i) > 1:
                new = np.concatenate([[True], i[1:] != i[:-1]])
                vfirst, i = vfirst[new], i[new]
            vlen = np.diff(np.concatenate([vfirst, [total]])).astype(np.int64)
            self._runs = (vfirst, vlen, i.astype(np.int64))
        return self._abs

    def to_parent(self, rows: np.ndarray | int) -> Any:
        """Parent logical rows of selection logical ``rows`` (same shape)."""
        return self._resolve()[rows] - self.parent.start

    # -- RowSource ------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return len(self._resolve())

    @property
    def start(self) -> int:
        self._resolve()
        return self._vstart

    @property
    def capacity(self) -> int | None:
        return None

    @property
    def live(self) -> bool:
        return self.parent.live

    @property
    def record(self) -> Head:
        return self.parent.record

    @property
    def committed(self) -> tuple[int, int]:
        rows = self._resolve()  # a writer's rows past its last commit are not committed
        return self._vstart, self._vstart + int(np.searchsorted(rows, self.parent.committed[1]))

    @property
    def reopen(self) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
        recipe = self.parent.reopen
        return None if recipe is None else (_reopen_selection, (recipe, self.ids))

    def sync(self) -> None:
        self.parent.sync()

    def pinned(self) -> contextlib.AbstractContextManager[None]:
        return self.parent.pinned()

    def refresh(self) -> bool:
        return self.parent.refresh()

    def rows_intact(self, before: Head) -> bool:
        return self.parent.rows_intact(before)

    def absolute_rows(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64) + self.start

    def logical_rows(self, absolute: np.ndarray, before: Head) -> np.ndarray | None:
        return rows_after_start(self, absolute, before)

    def read_rows(self, rows: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.parent.read_rows(self.to_parent(np.asarray(rows, np.int64)), leaves)

    def gather_windows(self, first: np.ndarray, length: int, leaves: Sequence[int]) -> list[np.ndarray]:
        rows = (np.asarray(first, np.int64)[:, None] + np.arange(length)).ravel()
        return [a.reshape(len(first), length, *a.shape[1:]) for a in self.read_rows(rows, leaves)]

    def leaf_field(self, leaf: int) -> Field | None:
        # The parent's field: its layout (dtype, shape, chunk rows) sizes dask chunks; rows are
        # always read through read_rows, which maps selection rows to the parent's.
        return self.parent.leaf_field(leaf)

    # -- EpisodeSource ----------------------------------------------------------------------------
    @property
    def current_episode_id(self) -> int:
        return self.parent.current_episode_id

    def step_ids(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        return self.parent.step_ids(self.to_parent(rows.ravel())).reshape(rows.shape)

    def window_ids(self, first: np.ndarray, length: int) -> np.ndarray:
        return self.step_ids(np.asarray(first, np.int64)[:, None] + np.arange(length))

    def one_run(self, first: np.ndarray, span: int) -> np.ndarray:
        self._resolve()
        vfirst, vlen, _ = self._runs
        first = np.asarray(first, np.int64)
        if not len(vfirst):
            return np.zeros(first.shape, bool)
        k = np.clip(np.searchsorted(vfirst, first, side="right") - 1, 0, len(vfirst) - 1)
        return (first >= vfirst[k]) & (first + span < vfirst[k] + vlen[k])

    def runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self._resolve()
        return self._runs

    def read_episode_rows(self, anchors: np.ndarray, leaves: Sequence[int]) -> list[np.ndarray]:
        return self.parent.read_episode_rows(self.to_parent(anchors), leaves)

    def episode_data_stale(self, rows: np.ndarray, before: Head) -> np.ndarray:
        """The parent's :meth:`TrajectoryRows.episode_data_stale` of the steps ``rows`` select."""
        rows = np.asarray(rows, np.int64)
        return self.parent.episode_data_stale(self.to_parent(rows), before)


def short_ids(ids: np.ndarray) -> str:
    """Episode ids for messages and names: all of up to 6, else the first two and the last."""
    return str(ids.tolist()) if len(ids) <= 6 else f"[{ids[0]}, {ids[1]}, ... {ids[-1]}] ({len(ids)} ids)"


def _reopen_selection(recipe: tuple[Callable[..., Any], tuple[Any, ...]], ids: np.ndarray) -> SelectionRows:
    """The selection ``ids`` of the rows ``recipe`` reopens (another process: dask workers)."""
    fn, args = recipe
    return SelectionRows(fn(*args), ids)
