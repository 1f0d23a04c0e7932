"""What the store-backed SB3 buffers share: opening their folder, per-env reads of the stored
observations, read-only SB3-shaped views, committing, closing and pickling as a small handle.
"""

from __future__ import annotations

import atexit
import copy
import os
import weakref
from typing import TYPE_CHECKING, Any, Sequence

import gymnasium
import numpy as np

from trajstore.buffers.replay import ReplayBuffer as StoreBuffer
from trajstore.buffers.replay import ZarrStorage
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.buffers.views import ColumnView
from trajstore.core.ring import distinct
from trajstore.errors import (
    BadArgumentError,
    ClosedError,
    DamagedStoreError,
    ReadOnlyError,
    SpaceMismatchError,
    StoreNotFoundError,
)
from trajstore.sb3 import _root
from trajstore.sb3._layout import ObsLayout, PerKey
from trajstore.spaces import space_from_json

__all__ = ["ZarrBufferMixin", "PositionView"]

#: Every open buffer, closed (committed) at interpreter exit.
_LIVE: "weakref.WeakSet[ZarrBufferMixin]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for buf in list(_LIVE):
        try:
            buf.close()
        except Exception:  # interpreter shutdown: never raise from here
            pass


class PositionView:
    """Read-only view of stored observations in SB3's shape ``(buffer_size, n_envs, *obs_shape)``.

    Indexing reads the rows it needs (``view[pos]``, ``view[pos_array, env_array]``,
    ``view[a:b]``); positions that hold no observation read as zeros, as in SB3's freshly
    zeroed arrays.  ``np.asarray(view)`` reads everything.  Training code should use
    ``sample``/``get``, which read only the drawn env of every row.
    """

    def __init__(self, owner: "ZarrBufferMixin", prefix: str, key: str | None) -> None:
        self._owner, self._prefix, self._key = owner, prefix, key
        lay = owner._layout
        self.dtype = lay.dtype[key]
        self.shape = (owner.buffer_size, lay.n_envs, *lay.shape[key])
        self.ndim = len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def _grid(self, positions: np.ndarray) -> np.ndarray:
        return self._owner._read_grid(self._prefix, self._key, positions)

    def __getitem__(self, idx: Any) -> np.ndarray:
        idx = idx if isinstance(idx, tuple) else (idx,)
        first, rest = (idx[0] if idx else slice(None)), idx[1:]
        every = np.arange(self.shape[0])
        if first is Ellipsis:
            return self._grid(every)[idx]
        if isinstance(first, slice):
            return self._grid(every[first])[(slice(None), *rest)]
        if isinstance(first, (int, np.integer)):
            return self._grid(every[[first]])[(0, *rest)]  # type: ignore[index]  # numpy's stubs: int | np.integer list
        pos = every[np.asarray(first)]  # int array or bool mask: numpy's own bounds checks
        uniq, inv = np.unique(pos, return_inverse=True)
        return self._grid(uniq)[(inv.reshape(pos.shape), *rest)]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self._grid(np.arange(self.shape[0]))
        return a if dtype is None else a.astype(dtype)

    def __setitem__(self, idx: Any, value: Any) -> None:
        raise ReadOnlyError("stored observations are read-only; add transitions with add()")

    def __repr__(self) -> str:
        return f"PositionView({self._prefix!r}, key={self._key!r}, shape={self.shape}, dtype={self.dtype})"


class ZarrBufferMixin:
    """Store-backed part of the SB3 buffer classes (mixed in before SB3's class).

    Subclasses set ``_layout`` and call :meth:`_init_root`, open their stores with
    :meth:`_open_replay` / :meth:`_open_trajectory`, and implement ``_logical_of`` (SB3
    position -> store row), ``_before_commit`` (persist RAM state), ``_snapshot`` /
    ``_restore`` (pickling of temporary buffers) and ``_ctor_kwargs`` (constructor arguments
    that reopen the buffer).
    """

    KIND = ""  # the class name, recorded in sb3.json
    _main = ""  # the part holding the observations ("transitions", "rollout")
    _layout: ObsLayout
    _root: _root.StoreRoot
    buffer_size: int
    n_envs: int
    device: Any
    if TYPE_CHECKING:  # set by SB3's BaseBuffer, which every concrete class derives from after this mixin
        observation_space: gymnasium.Space
        action_space: gymnasium.Space
        action_dim: int
        pos: int
        full: bool

    # -- opening ----------------------------------------------------------------------------------
    def _init_root(self, cache_path: Any, storage_options: dict[str, Any] | None, overwrite: bool,
                   config: dict[str, Any], parts: list[str], storage_kwargs: dict[str, Any],
                   resume: bool | None = None) -> bool:
        """Resolve ``cache_path``, check or prepare its record; True when the buffer is new.

        Raises
        ------
        BadArgumentError
            A keyword argument that is neither SB3's nor a trajstore storage option (a
            ``TypeError`` worded as Python's own, which SB3's callers match on).
        """
        self.closed = True
        unknown = sorted(set(storage_kwargs) - set(ZarrStorage.CREATE_OPTIONS))
        if unknown:
            raise BadArgumentError(f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                                   f"{unknown[0]!r} (trajstore storage options: {', '.join(ZarrStorage.CREATE_OPTIONS)})")
        self._stores: dict[str, Any] = {}
        self._cols: dict[str, ColumnView] = {}
        self._root = _root.StoreRoot(cache_path, storage_options)
        self._create_opts, self._open_opts = _root.storage_split(storage_kwargs)
        self._config = config
        self._parts = parts
        created = self._root.prepare(self.KIND, config, parts, overwrite, resume)
        _root.register(self._root, self)
        self.closed = False
        _LIVE.add(self)
        return created

    def _finish_create(self) -> None:
        """Drop parts of a replaced buffer that were not recreated, then write ``sb3.json`` (last,
        so a half-created folder has none)."""
        self._root.drop_parts(self._parts, {name.split("/")[0] for name in self._stores})
        self._root.write_config({"kind": self.KIND, **self._config})

    def _store_opts(self, create: bool, name: str = "", space: gymnasium.Space | None = None) -> dict[str, Any]:
        """Storage options for creating or for reopening a part (trajstore's defaults otherwise:
        raw memory-mapped chunks on local folders, lz4 on remote URLs); a ``compressor`` dict by SB3
        name (``{"obs": "jpeg:90"}``) is resolved to the leaves of part ``name`` (of ``space``)."""
        opts = dict(self._create_opts if create else self._open_opts)
        if create and isinstance(opts.get("compressor"), dict) and isinstance(space, gymnasium.spaces.Dict):
            opts["compressor"] = _root.part_compressor(opts["compressor"], list(space.spaces), name == self._main)
        return opts

    def _open_replay(self, name: str, space: gymnasium.Space, capacity: int | None, create: bool,
                     required: bool = True) -> StoreBuffer:
        """Create (``create``) or open the trajstore ReplayBuffer ``name`` of this buffer's folder.

        Reopening a buffer whose ``required`` part is missing raises DamagedStoreError (never
        silently replaced by an empty one).
        """
        path = self._root.sub(name)
        so = self._root.storage_options
        if not create and not self._root.exists(name) and required:
            raise DamagedStoreError(f"{self._root.path}: {_root.CONFIG_KEY} is there but part {name!r} is missing")
        if create or not self._root.exists(name):
            rb = StoreBuffer.create(space, cache_path=path, capacity=capacity, storage_options=so, overwrite=True,
                                    **self._store_opts(True, name, space))
        else:
            rb = StoreBuffer.load_from(path, storage_options=so, single_instance_space=space, **self._store_opts(False))
            if rb.capacity != capacity:
                rb.close()
                raise SpaceMismatchError(f"{path}: stored capacity {rb.capacity}; expected {capacity}")
        self._stores[name] = rb
        return rb

    def _open_trajectory(self, name: str, step_space: gymnasium.Space, capacity: int | None,
                         create: bool) -> TrajectoryReplayBuffer:
        """Create (``create``, or when missing) or open the TrajectoryReplayBuffer ``name``."""
        path = self._root.sub(name)
        so = self._root.storage_options
        if not create and self._root.exists(name):
            tb = TrajectoryReplayBuffer.load_from(path, storage_options=so, **self._store_opts(False))
            if tb.step_space != step_space:
                tb.close()
                raise SpaceMismatchError(f"{path}: stored step space {tb.step_space} differs from {step_space}")
        else:
            tb = TrajectoryReplayBuffer.create(step_space, step_data_capacity=capacity, cache_path=path,
                                               storage_options=so, overwrite=True,
                                               **self._store_opts(True, name, step_space))
        self._stores[name] = tb
        return tb

    # -- reads --------------------------------------------------------------------------------------
    def _column(self, leaf: str) -> ColumnView:
        """Cached lazy view of one leaf of the main part."""
        col = self._cols.get(leaf)
        if col is None:
            col = self._cols[leaf] = self._stores[self._main].get_column([leaf])
        return col

    def _gather(self, prefix: str, logical: np.ndarray, env_indices: np.ndarray | None) -> PerKey:
        """Observations of store rows ``logical`` (B,), env ``env_indices[b]`` for row b (None: env 0).

        Returns ``{key: (B, *shape)}``; each env's leaf is read once, results land in batch order.
        Rows the store does not hold (a buffer whose ``full`` was set by hand, as SB3's tests do)
        read as zeros, as SB3's preallocated arrays do.
        """
        lay = self._layout
        held = len(self._stores[self._main])
        if len(logical) and int(logical.max()) >= held:
            out = lay.zeros(len(logical))
            have = np.flatnonzero(logical < held)
            if have.size:
                part = self._gather(prefix, logical[have], None if env_indices is None else env_indices[have])
                for k in lay.keys:
                    out[k][have] = part[k]
            return out
        if lay.n_envs == 1 or env_indices is None:
            return {k: self._column(lay.leaf(prefix, 0, k))[logical] for k in lay.keys}
        out = lay.empty(len(logical))
        for e in distinct(env_indices).tolist():
            sel = np.flatnonzero(env_indices == e)
            rows = logical[sel]
            for k in lay.keys:
                out[k][sel] = self._column(lay.leaf(prefix, e, k))[rows]
        return out

    def _read_env(self, prefix: str, env: int, lo: int, hi: int) -> PerKey:
        """Contiguous store rows ``[lo, hi)`` of env ``env``: ``{key: (hi - lo, *shape)}`` (zeros
        past the rows the store holds, as in :meth:`_gather`)."""
        lay = self._layout
        end = min(hi, len(self._stores[self._main]))
        if end >= hi:
            return {k: self._column(lay.leaf(prefix, env, k))[lo:hi] for k in lay.keys}
        out = lay.zeros(hi - lo)
        if end > lo:
            for k in lay.keys:
                out[k][:end - lo] = self._column(lay.leaf(prefix, env, k))[lo:end]
        return out

    def _logical_of(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store rows of SB3 positions and which positions hold a row."""
        raise NotImplementedError  # abstract

    def _read_grid(self, prefix: str, key: str | None, positions: np.ndarray) -> np.ndarray:
        """``(len(positions), n_envs, *shape)`` observations at SB3 positions (zeros where none)."""
        lay = self._layout
        logical, valid = self._logical_of(np.asarray(positions, dtype=np.int64))
        out = np.zeros((len(positions), lay.n_envs, *lay.shape[key]), lay.dtype[key])
        rows = logical[valid]
        if rows.size:
            for e in range(lay.n_envs):
                out[valid, e] = self._column(lay.leaf(prefix, e, key))[rows]
        self._patch_grid(prefix, key, positions, out)
        return out

    def _patch_grid(self, prefix: str, key: str | None, positions: np.ndarray, out: np.ndarray) -> None:
        """Hook: fill positions whose observation is not a store row (replay: the pending one)."""

    def _tensor(self, array: np.ndarray) -> Any:
        """A tensor on ``device`` of a fresh, private array (shares its memory on CPU)."""
        return self.to_torch(array, copy=False)  # type: ignore[attr-defined]

    def _views(self, prefix: str) -> PositionView | dict[str, PositionView]:
        lay = self._layout
        views = {k: PositionView(self, prefix, k) for k in lay.keys}
        return lay.wrap(views)  # type: ignore[arg-type, return-value]

    # -- state ------------------------------------------------------------------------------------
    @property
    def cache_path(self) -> str:
        """Folder (or URL) of the buffer; a temporary folder when it was created with ``cache_path=None``."""
        return self._root.path

    @property
    def temporary(self) -> bool:
        """True when the folder is temporary (``cache_path=None``) and removed by :meth:`close`."""
        return self._root.temporary

    def _check_open(self) -> None:
        if getattr(self, "closed", True):
            raise ClosedError(f"I/O operation on a closed {type(self).__name__}")

    def _before_commit(self) -> None:
        """Hook: write RAM state that belongs in the stores."""

    def flush(self, fsync: bool = False) -> None:
        """Commit everything added so far (``fsync=True``: durable against power loss too).

        Rows are also committed automatically while adding (every ``commit_interval`` seconds,
        1 s by default), so a process killed at any instant keeps every committed transition.
        """
        self._check_open()
        self._before_commit()
        for store in self._stores.values():
            store.flush(fsync=fsync)

    def close(self) -> None:
        """Commit, release the stores and their locks; a temporary folder is deleted."""
        if getattr(self, "closed", True):
            return
        try:
            self.flush()
        finally:
            self._release(strict=True)

    def _release(self, strict: bool = False) -> None:
        """Close the stores (each commits its rows), forget the buffer, delete a temporary folder.

        Without ``strict`` (cleanup after a failed construction) errors are swallowed.
        """
        self.closed = True
        errors = []
        for store in getattr(self, "_stores", {}).values():
            try:
                store.close()
            except Exception as e:
                errors.append(e)
        if hasattr(self, "_root"):
            _root.unregister(self._root, self)
            _LIVE.discard(self)
            self._root.remove()
        if strict and errors:
            raise errors[0]

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- pickling ---------------------------------------------------------------------------------
    def _ctor_kwargs(self) -> dict[str, Any]:
        """Constructor arguments besides the spaces, sizes and storage arguments."""
        raise NotImplementedError  # abstract

    @classmethod
    def _sizes_from_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments ``buffer_size``, ``n_envs`` recorded in ``sb3.json``."""
        raise NotImplementedError  # abstract

    @classmethod
    def _options_from_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments recorded in ``sb3.json`` that :meth:`open` takes from there
        unless given (none here)."""
        return {}

    def _snapshot(self) -> dict[str, Any]:
        raise NotImplementedError  # abstract

    def _restore(self, snap: dict[str, Any]) -> None:
        raise NotImplementedError  # abstract

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """An independent copy of the buffer in a new temporary folder (its ``cache_path``,
        deleted when the copy is closed or collected; ``temporary`` is True).

        The copy holds every committed row and the RAM arrays (actions, rewards, dones, ...) as
        they are now, so it compares equal to this buffer and stays as it is while this buffer
        goes on (what SB3's ``deepcopy(buffer)`` gives); this buffer is committed first.  An env
        the buffer refers to (HER's ``env``) is shared, not copied.  Copying reads every row: use
        it for small buffers and tests.
        """
        self._check_open()
        kwargs = dict(self._ctor_kwargs(), observation_space=self.observation_space, action_space=self.action_space,
                      **self._sizes_from_config(self._config), **self._create_opts)
        dup = _restore(type(self), kwargs, str(self.device), self._snapshot())
        memo[id(self)] = dup
        for name, value in vars(self).items():  # RAM state as it is now (edits not in the store included)
            mine = vars(dup).get(name)
            if isinstance(value, np.ndarray) and isinstance(mine, np.ndarray) and mine.shape == value.shape:
                mine[...] = copy.deepcopy(value, memo) if value.dtype == object else value  # (HER's infos)
        dup.pos, dup.full = self.pos, self.full
        self._after_copy(dup)
        return dup

    def _after_copy(self, dup: Any) -> None:
        """Hook of :meth:`__deepcopy__`: share what the copy refers to but does not own (HER's env)."""

    @classmethod
    def open(cls, cache_path: str | os.PathLike[str], *, device: Any = "auto",
             storage_options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """Reopen the buffer at ``cache_path`` with the spaces and sizes recorded there.

        ``kwargs`` are the other constructor arguments (e.g. ``handle_timeout_termination``,
        ``commit_interval``); ``resume`` is True (reopening is what was asked); those recorded in
        ``sb3.json`` (``optimize_memory_usage``) default to the recorded value.  Raises
        ``StoreNotFoundError`` when there is no buffer.
        """
        kwargs.setdefault("resume", True)
        cfg = _root.StoreRoot(cache_path, storage_options).read_config()
        if cfg is None:
            raise StoreNotFoundError(f"no trajstore stable-baselines3 buffer at {os.fspath(cache_path)!r}")
        kwargs = {**cls._options_from_config(cfg), **kwargs}
        spaces_ = {name: space_from_json(cfg[name]) for name in ("observation_space", "action_space")}
        ctor: Any = cls  # a concrete class: SB3's constructor plus the storage arguments
        return ctor(**spaces_, **cls._sizes_from_config(cfg), device=device, cache_path=cache_path,
                    storage_options=storage_options, **kwargs)

    def __reduce__(self) -> Any:
        """Pickle as a small handle: the buffer is committed and reopens from ``cache_path``.

        This is what ``save_replay_buffer`` writes: a pointer of about a kilobyte, not the data
        (so the file is not self-contained).  Unpickling in a process where a buffer already
        holds that ``cache_path`` (e.g. the one ``SAC.load`` rebuilt) returns that buffer.  A
        temporary buffer (``cache_path=None``) has no folder to point to: it pickles its data,
        like SB3's buffers.
        """
        self._check_open()
        kwargs = self._ctor_kwargs()
        if self.temporary:
            full = dict(kwargs, observation_space=self.observation_space, action_space=self.action_space,
                        **self._sizes_from_config(self._config))
            return (_restore, (type(self), full, str(self.device), self._snapshot()))
        self.flush()
        return (_reopen, (type(self), self._root.path, self._root.storage_options, {**self._open_opts, **kwargs},
                          str(self.device)))


def _reopen(cls: Any, path: str, storage_options: dict[str, Any] | None, kwargs: dict[str, Any], device: str) -> Any:
    live = _root.lookup(_root.StoreRoot(path, storage_options).key)
    if live is not None and isinstance(live, cls):
        return live
    return cls.open(path, device=device, storage_options=storage_options, **kwargs)


def _restore(cls: type, kwargs: dict[str, Any], device: str, snap: dict[str, Any]) -> Any:
    buf = cls(**kwargs, device=device, cache_path=None)
    buf._restore(snap)
    return buf


def take(per_key: PerKey, idx: Any) -> PerKey:
    """Rows ``idx`` (any numpy index along axis 0) of every key's array."""
    return {k: v[idx] for k, v in per_key.items()}


def concat(parts: Sequence[PerKey]) -> PerKey:
    """The arrays of ``parts`` (at least one, all with the same keys) joined along axis 0, key by key."""
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

