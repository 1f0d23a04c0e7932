"""``open_sharded``: a read-only buffer over every shard of a sharded dataset.

Shards are ordinary stores (one writer each) under ``<root>/shards/``; this opens each one
read-only and reads them as one sequence of rows through :class:`~trajstore.shards.rows.ShardedRows`,
so uniform samples, sequence windows and episodes come from the same samplers a single store
uses.  New shards and new rows are picked up by :meth:`ShardedDataset.refresh`, and
automatically before reads as single read-only stores do (the commit record of every shard that
committed since the last read, :mod:`trajstore.shards.watch`; the list of shards at most every
:data:`DISCOVER_INTERVAL_S` seconds).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import numpy as np

from trajstore.buffers.backend import Backend
from trajstore.buffers.base import as_generator
from trajstore.buffers.episode_windows import EpisodeWindows
from trajstore.buffers.replay import ReplayBuffer
from trajstore.buffers.trajectory import TrajectoryData, TrajectoryReplayBuffer
from trajstore.buffers.trajectory_layout import TrajectoryOutput, as_trajectory_data
from trajstore.buffers.views import BatchBase
from trajstore.core.ring import IndexLike
from trajstore.errors import BadArgumentError, ClosedError, DamagedStoreError, NotATrajstoreError
from trajstore.sampling import sequences as _seq
from trajstore.sampling.source import put_rows, read_consistent, sample_consistent
from trajstore.shards.layout import (
    RootRecord,
    list_shards,
    read_root_record,
    root_location,
    shard_ready,
    shard_url,
)
from trajstore.shards.rows import EPISODE_STRIDE, ShardedRows
from trajstore.spaces import ValuePlan, space_from_json
from trajstore.storage.location import Location

__all__ = ["DISCOVER_INTERVAL_S", "ShardedDataset", "ShardedTrajectories", "open_sharded"]

_T = TypeVar("_T")

#: Between automatic refreshes, the shard list is read again at most this often (seconds); a
#: shard's new commits are seen by the next read, as a single store's are (trajstore.shards.watch).
DISCOVER_INTERVAL_S = 1.0

_CLASSES: dict[str, type[ReplayBuffer] | type[TrajectoryReplayBuffer]] = {
    "ReplayBuffer": ReplayBuffer, "TrajectoryReplayBuffer": TrajectoryReplayBuffer}


def open_sharded(path: str | os.PathLike[str], *, backend: str = "numpy", device: Any = None,
                 storage_options: dict[str, Any] | None = None) -> "ShardedDataset":
    """Open the sharded dataset at ``path`` (a local folder or an fsspec URL) read-only.

    Parameters
    ----------
    path : str or os.PathLike
        The dataset root that :func:`~trajstore.shards.create_shard` writes shards under.
    backend, device
        What reads return, as for ``load_from``: ``"numpy"`` arrays or ``"torch"`` tensors on ``device``.
    storage_options : dict, optional
        fsspec options for a URL (every shard is opened with them).

    Returns
    -------
    ShardedTrajectories or ShardedDataset
        For trajectory shards (episodes, sequences) or ReplayBuffer shards (rows).

    Raises
    ------
    StoreNotFoundError
        No folder at ``path``.
    NotATrajstoreError
        ``path`` holds no sharded dataset (no ``trajstore.shards.json``).
    DamagedStoreError, FormatVersionError
        The root record or a shard is damaged, a shard is a link or has other spaces.
    """
    p = os.fspath(path)
    loc = root_location(p, read_only=True, storage_options=storage_options)
    root = read_root_record(loc)
    if root is None:
        raise NotATrajstoreError(f"{loc.url}: not a sharded dataset (no trajstore.shards.json at its root; "
                                 "create_shard writes it with the first shard)")
    cls = ShardedTrajectories if root.kind == "TrajectoryReplayBuffer" else ShardedDataset
    return cls(p, loc, root, Backend(backend, device), storage_options)


def _reopen_rows(path: str, storage_options: dict[str, Any] | None) -> ShardedRows:
    """The rows of the dataset at ``path``, opened in this process (dask workers)."""
    return open_sharded(path, storage_options=storage_options).row_source()


class ShardedDataset(BatchBase):
    """Every shard of a sharded dataset read as one read-only buffer of ReplayBuffer rows
    (:class:`ShardedTrajectories` for trajectory shards); see :func:`open_sharded`.

    Rows are the shards' committed rows, shards in name order: global row ``i`` is row
    ``i - shards["start"][k]`` of shard ``k``.  Indexing (``ds[i]``, ``get_at``, slices, arrays,
    masks), ``len``, ``sample``, ``get_column`` and ``to_dask`` work as on a read-only buffer.
    """

    def __init__(self, path: str, loc: Location, root: RootRecord, backend: Backend,
                 storage_options: dict[str, Any] | None) -> None:
        self.path = path
        self.storage_options = storage_options
        self.kind = root.kind
        self._loc = loc
        self._root = root
        self._backend = backend
        self._rng = np.random.default_rng()
        self._closed = False
        self._buffers: dict[str, Any] = {}
        self._listed = -np.inf
        spaces = {k: space_from_json(v) for k, v in root.spaces.items()}
        self._spaces = spaces
        self.single_space = self._space(spaces)
        self._plan = ValuePlan(self.single_space)
        self._rows = ShardedRows(str(loc.url), self._discover, (_reopen_rows, (path, storage_options)))
        self._rows.refresh_all()

    def _space(self, spaces: dict[str, Any]) -> Any:
        return spaces["step_data"]

    # -- shards ----------------------------------------------------------------------------------
    def _discover(self, force: bool) -> bool:
        """Open shards that appeared since the last listing (``force=False``: at most every
        :data:`DISCOVER_INTERVAL_S` seconds); True when some did."""
        if self._closed:
            raise ClosedError("I/O operation on a closed sharded dataset")
        now = time.monotonic()
        if not force and now - self._listed < DISCOVER_INTERVAL_S:
            return False
        self._listed = now
        new = [n for n in list_shards(self._loc) if n not in self._buffers and shard_ready(self._loc, n)]
        if not new:
            return False
        for name in new:
            self._buffers[name] = self._open_shard(name)
        names = sorted(self._buffers)
        self._rows.set_shards(names, [self._buffers[n].row_source() for n in names])
        return True

    def _open_shard(self, name: str) -> Any:
        buf = _CLASSES[self.kind].load_from(shard_url(self.path, name), read_only=True,
                                            storage_options=self.storage_options)
        if buf.store.attrs.get("spaces") != self._root.spaces:
            buf.close()
            raise DamagedStoreError(f"{self._loc.url}: shard {name!r} holds other spaces than the dataset's "
                                    "trajstore.shards.json records")
        next_id = int(buf.store.committed.state.get("next_episode_id", 0))
        if next_id >= EPISODE_STRIDE:  # global ids are shard * 2**40 + the shard's own id
            buf.close()
            raise DamagedStoreError(f"{self._loc.url}: shard {name!r} numbers its episodes up to {next_id}; a sharded "
                                    f"dataset reads shards whose episode ids stay below 2**40")
        return buf

    def refresh(self) -> bool:
        """Adopt new shards and every shard's newest commit; True when anything changed.

        Reads do this automatically (new commits of every shard before every read, the shard
        list at most every :data:`DISCOVER_INTERVAL_S` seconds); call it to see a new shard at once.
        """
        return self._rows.refresh_all()

    @property
    def shards(self) -> dict[str, np.ndarray]:
        """``{"shard": names, "rows": committed rows, "start": global row of each shard's first
        row}``, shards in name order (the view the last read used)."""
        self._rows.sync()
        cum = self._rows.cum
        return {"shard": np.array(self._rows.names, dtype=object), "rows": np.diff(cum), "start": cum[:-1].copy()}

    def shard(self, name: str) -> Any:
        """The read-only buffer of shard ``name`` (a ``TrajectoryReplayBuffer`` or ``ReplayBuffer``;
        closed with this dataset).

        Raises
        ------
        KeyError
            No shard of that name is open (call :meth:`refresh` for one created just now).
        """
        self._rows.sync()
        return self._buffers[name]

    @property
    def options(self) -> dict[str, Any]:
        """The create options the first shard recorded (the defaults of later shards)."""
        return dict(self._root.options)

    def row_source(self) -> ShardedRows:
        """Every shard's rows as one :class:`~trajstore.sampling.source.RowSource`."""
        return self._rows

    # -- reads -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        self._rows.sync()
        return self._rows.count

    @property
    def count(self) -> int:
        """Rows of every shard (``len(self)``)."""
        return len(self)

    @property
    def read_only(self) -> bool:
        """Always True: shards are written through :func:`~trajstore.shards.create_shard`'s buffers."""
        return True

    @property
    def cache_path(self) -> str:
        """The dataset root as given to :func:`open_sharded`."""
        return self.path

    def _consistent(self, read: Callable[[], _T]) -> _T:
        return read_consistent(self._rows, read)

    def _read(self, idx: int | np.ndarray, leaf_ids: Sequence[int]) -> list[np.ndarray]:
        if self._closed:
            raise ClosedError("I/O operation on a closed sharded dataset")
        if isinstance(idx, (int, np.integer)):
            return [a[0] for a in self._rows.read_rows(np.array([int(idx)], np.int64), leaf_ids)]
        return self._rows.read_rows(np.asarray(idx, dtype=np.int64), leaf_ids)

    @property
    def default_rng(self) -> np.random.Generator:
        """The generator draws use when given no ``rng`` (this dataset's own)."""
        return self._rng

    def sample(self, batch_size: int, *, rng: np.random.Generator | int | None = None) -> Any:
        """``batch_size`` rows drawn uniformly (with replacement) from every row of every shard.

        Raises
        ------
        EmptyBufferError
            No shard holds a row yet.
        """
        gen = as_generator(rng, self._rng)
        rows = self._rows
        arrays = sample_consistent(rows, lambda k: gen.integers(0, rows.count, size=k),
                                   lambda idx: rows.read_rows(idx, self._all_leaves), batch_size, put_rows)
        return self._plan.from_arrays([self._backend.out(a) for a in arrays])

    def dask_leaves(self, leaves: Sequence[int]) -> list[Any]:
        """One dask array per leaf: the committed rows of every shard, concatenated in name order
        (what ``to_dask`` of the dataset or of a column of it returns, nested as the space).  Each
        shard's own rows: the dataset's global row numbers are this process's only."""
        import dask.array as da

        from trajstore.sampling.dask_arrays import dask_arrays

        self._rows.sync()
        if not self._rows.sources:
            raise BadArgumentError(f"{self._loc.url}: the dataset has no shard yet; nothing to make dask arrays of")
        per_shard = [dask_arrays(s, leaves) for s in self._rows.sources]
        return [da.concatenate([arrays[j] for arrays in per_shard], axis=0) for j in range(len(leaves))]

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every shard (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._rows.close()
        for buf in self._buffers.values():
            buf.close()

    def __enter__(self) -> "ShardedDataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        return (_reopen, (self.path, self._backend.name, self._backend.device, self.storage_options))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, shards={len(self._rows.names)}, len={self._rows.count})"


def _reopen(path: str, backend: str, device: Any, storage_options: dict[str, Any] | None) -> ShardedDataset:
    return open_sharded(path, backend=backend, device=device, storage_options=storage_options)


class ShardedTrajectories(EpisodeWindows, ShardedDataset):
    """A sharded dataset of trajectory shards: reads return :class:`~trajstore.TrajectoryData`,
    and sequences and episodes work as on a :class:`~trajstore.TrajectoryReplayBuffer`.

    Windows never cross shards.  Episode ids are global: episode ``e`` of the ``k``-th shard (name
    order) is ``k * 2**40 + e``; :meth:`episodes` lists both and the shard's name.
    """

    def _space(self, spaces: dict[str, Any]) -> Any:
        import gymnasium

        self.step_space = spaces["step_data"]
        self.episode_space = spaces.get("episode_data")
        self.output = TrajectoryOutput(ValuePlan(self.step_space),
                                       ValuePlan(self.episode_space) if self.episode_space is not None else None,
                                       self._backend)
        return gymnasium.spaces.Dict({"step_data": self.step_space} |
                                     ({"episode_data": self.episode_space} if self.episode_space is not None else {}))

    def get_at(self, idx: IndexLike) -> TrajectoryData:
        """Steps at global rows ``idx`` with their episodes' data (see
        :meth:`TrajectoryReplayBuffer.get_at <trajstore.TrajectoryReplayBuffer.get_at>`)."""
        return as_trajectory_data(super().get_at(idx))

    def sample(self, batch_size: int, *, rng: np.random.Generator | int | None = None) -> TrajectoryData:
        """``batch_size`` steps drawn uniformly from every step of every shard, with their
        episodes' data."""
        return as_trajectory_data(super().sample(batch_size, rng=rng))

    def episodes(self) -> dict[str, np.ndarray]:
        """One entry per episode with steps present, in row order: ``episode_id`` (global),
        ``shard`` (its name), ``shard_episode_id`` (the id inside the shard), ``start`` (global
        row of its first step), ``length`` and ``live`` (its shard's writer is still recording it)."""
        rows = self._rows
        rows.sync()
        with contextlib.ExitStack() as stack:
            for s in rows.sources:  # each shard's table as of the view (episode_table syncs its source)
                stack.enter_context(s.pinned())
            tables = [_seq.episode_table(s) for s in rows.sources]
        cols: dict[str, list[np.ndarray]] = {k: [] for k in
                                             ("episode_id", "shard", "shard_episode_id", "start", "length", "live")}
        for k, t in enumerate(tables):
            cols["episode_id"].append(t["episode_id"] + k * EPISODE_STRIDE)
            cols["shard"].append(np.full(len(t["episode_id"]), rows.names[k], dtype=object))
            cols["shard_episode_id"].append(t["episode_id"])
            cols["start"].append(t["start"] + rows.cum[k])
            cols["length"].append(t["length"])
            cols["live"].append(t["live"])
        empty = {"shard": np.zeros(0, object), "live": np.zeros(0, bool)}
        return {k: np.concatenate(v) if v else empty.get(k, np.zeros(0, np.int64)) for k, v in cols.items()}
