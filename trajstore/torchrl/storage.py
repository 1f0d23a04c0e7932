"""``TrajstoreStorage``: a TorchRL ``Storage`` whose rows live in a trajstore store on disk.

TorchRL addresses a storage by slot: ``RoundRobinWriter`` writes slot ``cursor % max_size`` and its
samplers read slots ``0 .. len - 1``.  Here slot ``s`` is the store's physical ring row ``s``, so
logical row ``(s - offset) % capacity`` (docs/design.md 1, "Ring rules"), and the writer's cursor,
the ring seam TorchRL's ``SliceSampler`` reads from ``_last_cursor_index`` and the store's own
overwrite order are one and the same.  One exception: a ring whose wrap a crash cut short (it
holds fewer rows than its capacity but no longer starts at physical row 0, docs/design.md 3)
is opened with its slots counted from its oldest row, so slots ``0 .. len - 1`` are its rows and
the next append fills the gap at slot ``len`` (:meth:`TrajstoreStorage.next_slot`).  Writes at the next free slot are the store's ``extend``
(its commit protocol, docs/design.md 3.1-3.3); writes into slots already written (``rb[i] = ...``,
``write_at``) are its ``set_at``.  A store that records episodes (a ``TrajectoryReplayBuffer``)
shows its step episode ids under ``traj_key`` (TorchRL's ``("collector", "traj_ids")`` by default).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, is_tensor_collection
from torchrl.data.replay_buffers.storages import Storage, StoreStorage

from trajstore.buffers.replay import ReplayBuffer
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import (
    BadArgumentError,
    BadIndexError,
    BadOptionError,
    EmptyBufferError,
    IndexOutOfRangeError,
    SpaceMismatchError,
    StoreNotFoundError,
)
from trajstore.maintenance.summary import open_store
from trajstore.torchrl.layout import (
    Leaves,
    check_leaves,
    space_from_leaves,
    space_from_spec,
    space_leaves,
    spec_leaves,
    tensordict_leaves,
)

__all__ = ["TrajstoreStorage"]

#: ``max_size`` of a store without a capacity (it grows without bound): no writer ever wraps.
UNBOUNDED = sys.maxsize // 2

_Buffer = ReplayBuffer | TrajectoryReplayBuffer


def _exists(path: str, storage_options: dict[str, Any] | None) -> str | None:
    """The store kind at ``path`` (``"ReplayBuffer"`` / ``"TrajectoryReplayBuffer"``), None if nothing is there."""
    try:
        store = open_store(path, storage_options)
    except StoreNotFoundError:
        return None
    try:
        return str(store.attrs.get("kind"))
    finally:
        store.close()


def _step_space(buf: _Buffer) -> Any:
    """The space of one step row (a trajectory store's ``single_space`` is ``{"step_data", "episode_data"}``)."""
    space: Any = buf.single_space
    return space["step_data"] if isinstance(buf, TrajectoryReplayBuffer) else space


def _slots(index: Any, n: int) -> tuple[np.ndarray, bool]:
    """TorchRL's index (int, slice over ``0 .. n-1``, list, array or tensor) as int64 slots, and
    whether it was a single int.  A tuple of one index is TorchRL's per-dimension form (``ndim == 1``)."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        return np.array([int(index)], np.int64), True
    if isinstance(index, torch.Tensor) and index.ndim == 0:
        return np.array([int(index)], np.int64), True
    if isinstance(index, slice):
        return np.arange(*index.indices(n), dtype=np.int64), False
    if isinstance(index, range):
        return np.asarray(index, np.int64), False
    arr = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    if arr.dtype == np.bool_:
        return np.flatnonzero(arr).astype(np.int64), False
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise BadIndexError(f"TrajstoreStorage is one-dimensional: an index is an int, a slice or a 1-D integer "
                            f"array; got {arr.dtype} of shape {arr.shape}")
    return arr.astype(np.int64), False


class TrajstoreStorage(StoreStorage):  # type: ignore[misc]  # torchrl ships no type information
    """A TorchRL storage backed by a trajstore store (local folder, ``.zip`` or fsspec URL).

    Parameters
    ----------
    path : str or os.PathLike
        The store.  If one is there it is opened (its spaces are the layout); otherwise it is
        created at the first write from the data's layout (or at once from ``spec``).
    max_size : int, optional
        The ring's capacity.  Default: the existing store's capacity; a new store needs it
        (``None`` on an existing store without a capacity: it grows without bound).
    spec : torchrl.data.Composite, optional
        The row layout (``env.full_observation_spec`` and friends combined).  A new store is
        created from it (``Bounded`` keeps its bounds, a scalar ``Categorical`` is a
        ``Discrete``); an existing store must match it key by key, shape and dtype, else
        ``SpaceMismatchError`` names what differs.
    traj_key : str or tuple of str
        The TensorDict key of the episode (trajectory) id.  Data that carries it at the first
        write creates a store that records episodes, and every write sets each step's episode
        id from it; reads put the step's id there (int64, shape ``(B,)``).
    read_only : bool
        Open an existing store for sampling only (no lock; writes raise ``ReadOnlyError``).
    storage_options : dict, optional
        fsspec options for a URL.
    **store_kwargs
        Storage options of a new store (``chunk_rows``, ``compressor``, ``fsync``,
        ``commit_interval``: README "Storage options").

    Notes
    -----
    A write is an append at the next free slot (``writer.add``/``extend``) or an overwrite of
    slots already written (``rb[idx] = ...``); any other slot raises ``BadIndexError``.  A fresh
    TorchRL writer starts at slot 0: on a store that already holds rows call :meth:`resume` (or
    restore the buffer's own ``state_dict``).  ``storage[:]`` reads every row, as TorchRL's
    ``SliceSampler`` does on each call unless ``cache_values=True``.
    """

    def __init__(self, path: str | os.PathLike[str], max_size: int | None = None, *, spec: Any = None,
                 traj_key: str | tuple[str, ...] = ("collector", "traj_ids"), read_only: bool = False,
                 storage_options: dict[str, Any] | None = None, **store_kwargs: Any) -> None:
        self.path = os.fspath(path)
        self.traj_key = traj_key
        self.read_only = read_only
        self.storage_options = storage_options
        self._store_kwargs = store_kwargs
        self._buf: _Buffer | None = None
        self._slot_origin: int | None = None
        self.device = torch.device("cpu")
        kind = _exists(self.path, storage_options)
        if kind is not None:
            self._buf = self._open(kind)
            self._slot_origin = None
            cap = self._buf.capacity
            if max_size is not None and cap is not None and int(max_size) != cap:
                raise BadOptionError(f"max_size={max_size}, but the store at {self.path!r} is a ring of {cap} rows")
            if max_size is not None and cap is None:
                raise BadOptionError(f"max_size={max_size}, but the store at {self.path!r} has no capacity "
                                     "(it grows without bound): leave max_size out")
            size = UNBOUNDED if cap is None else cap
            if spec is not None:
                check_leaves(self._layout(), spec_leaves(spec), "the TorchRL spec", exact_dtype=True)
        else:
            if max_size is None:
                raise BadOptionError(f"no store at {self.path!r}: a new store needs max_size")
            if read_only:
                raise StoreNotFoundError(f"no store at {self.path!r} to open read-only")
            size = int(max_size)
        # StoreStorage is TorchRL's family of out-of-core stores (its batches are read whole, so the
        # buffer's default collate passes them through); its own __init__ connects to Redis.
        Storage.__init__(self, size)
        if self._buf is not None:
            self._sync_cursor()
        elif spec is not None:
            self._create(space_from_spec(spec), episodes=self._traj() in spec_leaves(spec))

    # -- the store ----------------------------------------------------------------------------
    def _open(self, kind: str) -> _Buffer:
        cls: type[ReplayBuffer] | type[TrajectoryReplayBuffer]
        cls = TrajectoryReplayBuffer if kind == "TrajectoryReplayBuffer" else ReplayBuffer
        buf = cls.load_from(self.path, backend="torch", read_only=self.read_only,
                            storage_options=self.storage_options)
        space_leaves(_step_space(buf))  # a layout TensorDicts can hold, else UnsupportedSpaceError now
        return buf

    def _traj(self) -> tuple[str, ...]:
        return (self.traj_key,) if isinstance(self.traj_key, str) else tuple(self.traj_key)

    def _create(self, space: Any, *, episodes: bool) -> None:
        leaves = space_leaves(space)
        kw = dict(cache_path=self.path, backend="torch", storage_options=self.storage_options, **self._store_kwargs)
        cap = None if self.max_size == UNBOUNDED else self.max_size
        if episodes:
            step = space_from_leaves({k: v for k, v in leaves.items() if k != self._traj()})
            self._buf = TrajectoryReplayBuffer.create(step, step_data_capacity=cap, **kw)
        else:
            self._buf = ReplayBuffer.create(space, capacity=cap, **kw)

    @property
    def buffer(self) -> _Buffer:
        """The trajstore buffer holding the rows (``EmptyBufferError`` before the first write)."""
        if self._buf is None:
            raise EmptyBufferError(f"the store at {self.path!r} is created at the first write")
        return self._buf

    @property
    def episodes(self) -> bool:
        """Whether the store records episodes (their ids are read and written under ``traj_key``)."""
        return isinstance(self._buf, TrajectoryReplayBuffer)

    def _layout(self) -> Leaves:
        """The store's per-row layout as TorchRL sees it (episode ids under ``traj_key``)."""
        buf = self.buffer
        leaves = space_leaves(_step_space(buf))
        if isinstance(buf, TrajectoryReplayBuffer):
            leaves[self._traj()] = ((), np.dtype(np.int64))
        return leaves

    def _origin(self) -> int:
        """Physical row of slot 0: 0, except for a ring a crash left part-filled past its wrap
        (its oldest row then, fixed for this object's life so that slots never move)."""
        if self._slot_origin is None:
            buf = self.buffer
            n, cap = len(buf), buf.capacity
            self._slot_origin = buf.offset if cap is not None and 0 < n < cap else 0
        return self._slot_origin

    def next_slot(self) -> int:
        """The slot the next appended row goes to (TorchRL's writer cursor)."""
        if self._buf is None:
            return 0
        n, cap = len(self._buf), self._buf.capacity
        return n if cap is None else (self._buf.offset + n - self._origin()) % cap

    def _sync_cursor(self) -> None:
        if self._buf is not None and len(self._buf):
            self._set_last_cursor((self.next_slot() - 1) % self.max_size)

    def resume(self, rb: Any) -> None:
        """Point TorchRL replay buffer ``rb``'s writer at this store's next free slot (a new
        writer starts at 0; needed once when a buffer is built on a store that holds rows)."""
        n = len(self)
        rb.writer.load_state_dict({"_cursor": self.next_slot() % self.max_size, "_write_count": n})

    def flush(self, fsync: bool | None = None) -> None:
        """Commit every row written so far (the store also commits by itself, docs/design.md 1)."""
        if self._buf is not None and not self._buf.read_only:
            self._buf.flush(fsync)

    def close(self) -> None:
        """Commit and release the store (and its writer lock)."""
        if self._buf is not None:
            self._buf.close()
            self._buf = None
            self._slot_origin = None

    # -- TorchRL's Storage interface -----------------------------------------------------------
    def __len__(self) -> int:
        return 0 if self._buf is None else len(self._buf)

    @property
    def shape(self) -> torch.Size:
        """``(len,)``: the rows written so far (TorchRL's samplers read the storage's length from it)."""
        return torch.Size([len(self)])

    def _rows(self, slots: np.ndarray) -> np.ndarray:
        n, buf = len(self), self.buffer
        if slots.size and (slots.min() < 0 or slots.max() >= n):
            raise IndexOutOfRangeError(f"slot {int(slots.max() if slots.max() >= n else slots.min())} is out of "
                                       f"range for a storage of {n} rows")
        cap = buf.capacity
        return slots if cap is None else (slots + self._origin() - buf.offset) % cap

    def get(self, index: Any) -> Any:
        """The rows at slots ``index`` (int: one unbatched TensorDict; slice, array, tensor: a batch).

        A slice runs over ``0 .. len - 1``; a slot past the rows written raises ``IndexOutOfRangeError``.
        """
        slots, single = _slots(index, len(self))
        if self._buf is None:
            if slots.size:
                raise IndexOutOfRangeError(f"slot {int(slots[0])} is out of range for an empty storage")
            return TensorDict({}, batch_size=[0])
        td = self._read(self._rows(slots))
        return td[0] if single else td

    def _read(self, rows: np.ndarray) -> TensorDict:
        buf = self.buffer
        if isinstance(buf, TrajectoryReplayBuffer):
            value, meta = buf.get_at_with_metadata(rows)
            td = TensorDict(dict(value["step_data"]), batch_size=[len(rows)])
            td.set(self.traj_key, meta["episode_ids"])
            return td
        return TensorDict(dict(buf.get_at(rows)), batch_size=[len(rows)])

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Write TensorDict ``data`` (one row for an int ``cursor``, else a batch) at slots ``cursor``.

        ``set_cursor=True`` (the writer's ``add``/``extend``) appends: the slots must be the next
        free ones (``BadIndexError`` otherwise); ``set_cursor=False`` (``rb[idx] = ...``) overwrites
        rows already written.  The layout is checked first (``SpaceMismatchError``).
        """
        if isinstance(data, list):
            data = torch.stack(data)  # TorchRL's extend of a list of rows
        if not is_tensor_collection(data):
            raise BadArgumentError(f"TrajstoreStorage stores TensorDicts; got {type(data).__name__}")
        slots, single = _slots(cursor, self.max_size)
        if single:
            data = data.unsqueeze(0)
        if data.batch_size[:1] != torch.Size([len(slots)]):
            raise BadArgumentError(f"{len(slots)} slots for a batch of shape {tuple(data.batch_size)}")
        if self._buf is None:
            leaves = tensordict_leaves(data)
            self._create(space_from_leaves(leaves), episodes=self._traj() in leaves)
        check_leaves(self._layout(), tensordict_leaves(data), "the TensorDict")
        value = self._value(data)
        if set_cursor:
            self._append(slots, value)
            self._set_last_cursor(cursor)
        else:
            self.buffer.set_at(self._rows(slots), value)
        self._bump_mutation_revision()

    def _value(self, data: Any) -> Any:
        """The TensorDict as the buffer's value (its episode ids taken out of ``traj_key``)."""
        traj = self._traj() if self.episodes else None
        tree: dict[str, Any] = {}
        for k, v in data.items(include_nested=True, leaves_only=True):
            key = (k,) if isinstance(k, str) else tuple(k)
            if key == traj:
                continue
            node = tree
            for part in key[:-1]:
                node = node.setdefault(part, {})
            node[key[-1]] = v
        if traj is None:
            return tree
        return {"step_data": tree, "episode_ids": data.get(self.traj_key).reshape(-1)}

    def _append(self, slots: np.ndarray, value: Any) -> None:
        # A batch longer than the ring writes every slot, and its last ``max_size`` rows stay: the
        # store's extend keeps the same rows in the same slots (docs/design.md 1, "Ring rules").
        nxt, cap = self.next_slot(), self.max_size
        want = (nxt + np.arange(len(slots), dtype=np.int64)) % cap
        if not np.array_equal(slots, want):
            raise BadIndexError(
                f"the writer wrote slots starting at {int(slots[0]) if len(slots) else None}, but this store's next "
                f"free slot is {nxt} ({len(self)} rows): a writer appends in order; on a store that already holds "
                "rows call storage.resume(replay_buffer) first")
        self.buffer.extend(value)

    def contains(self, item: Any) -> Any:
        """Whether slot(s) ``item`` hold a row (a bool, or a bool tensor for several)."""
        slots, single = _slots(item, len(self))
        n = len(self)
        inside = torch.as_tensor((slots >= -n) & (slots < n))
        return bool(inside[0]) if single else inside

    def _empty(self) -> None:
        if self._buf is not None:
            self._buf.clear()
        self._set_last_cursor(None)
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, Any]:
        """Where the rows are, not the rows: the store's path, row count and ring offset (the data
        is on disk already; :meth:`dumps` copies it)."""
        self.flush()
        buf = self._buf
        return {"path": os.path.abspath(self.path) if "://" not in self.path else self.path,
                "rows": len(self), "offset": 0 if buf is None else buf.offset, "max_size": self.max_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that ``state_dict`` describes this store as it is now (TorchRL restores its writer
        and sampler from the same checkpoint): ``SpaceMismatchError`` names what differs."""
        mine = self.state_dict()
        diff = [f"{k}: checkpoint {state_dict.get(k)!r}, store {v!r}" for k, v in mine.items()
                if state_dict.get(k) != v]
        if diff:
            raise SpaceMismatchError("the storage state_dict is of another store or another moment of this one: "
                                     + "; ".join(diff) + " (restore the store itself with loads())")
        self._sync_cursor()
        self._bump_mutation_revision()

    def dumps(self, path: str | os.PathLike[str]) -> None:
        """Copy the store (every committed row and the ring's position) to ``path`` (a folder, ``.zip`` or URL)."""
        self.buffer.dumps(os.fspath(path))

    def loads(self, path: str | os.PathLike[str]) -> None:
        """Replace this storage's rows with the store at ``path`` (written by :meth:`dumps`)."""
        kind = _exists(os.fspath(path), self.storage_options)
        if kind is None:
            raise StoreNotFoundError(f"no store at {os.fspath(path)!r} to load")
        if os.path.abspath(os.fspath(path)) == os.path.abspath(self.path):
            self._sync_cursor()
            return
        self.close()
        cls = TrajectoryReplayBuffer if kind == "TrajectoryReplayBuffer" else ReplayBuffer
        src = cls.load_from(os.fspath(path), read_only=True, storage_options=self.storage_options)
        try:
            cap = src.capacity
            if (UNBOUNDED if cap is None else cap) != self.max_size:
                raise BadOptionError(f"the store at {os.fspath(path)!r} has capacity {cap}; "
                                     f"this storage {self.max_size}")
            src.dumps(self.path)
        finally:
            src.close()
        self._buf = self._open(kind)
        self._slot_origin = None
        self._sync_cursor()
        self._bump_mutation_revision()

    def __getstate__(self) -> dict[str, Any]:
        # The store crosses processes by path: the other side opens it (a second writer is refused).
        self.flush()
        state = Storage.__getstate__(self)  # StoreStorage's would look for its Redis length counter
        state["_buf"] = None
        state["_kind"] = None if self._buf is None else type(self._buf).__name__
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        kind = state.pop("_kind", None)
        Storage.__setstate__(self, state)
        if kind is not None:
            self._buf = self._open(kind)
            self._slot_origin = None

    def __repr__(self) -> str:
        return f"TrajstoreStorage({self.path!r}, max_size={self.max_size}, rows={len(self)})"
