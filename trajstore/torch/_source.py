"""A picklable, lazily opened read-only source of rows for the datasets.

Only ``(path, kind, storage_options)`` crosses a process boundary; every process (each
DataLoader worker, fork or spawn) opens its own read-only buffer on first use.  A buffer
passed by the user is used as is in the process that created the dataset.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from trajstore.buffers.base import StoredBuffer
from trajstore.buffers.replay import ReplayBuffer
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, NotATrajstoreError, UnknownFieldError
from trajstore.shards.dataset import ShardedDataset, open_sharded
from trajstore.shards.layout import is_sharded_root
from trajstore.spaces import ValuePlan, leaves, subspace

__all__ = ["BufferSource", "ShardedSource", "make_source", "FieldSelection"]

_KINDS: dict[str, type[ReplayBuffer] | type[TrajectoryReplayBuffer]] = {
    "ReplayBuffer": ReplayBuffer, "TrajectoryReplayBuffer": TrajectoryReplayBuffer}


def _store_kind(path: str, storage_options: dict[str, Any] | None) -> str:
    from trajstore.maintenance.summary import open_store

    store = open_store(path, storage_options)
    try:
        return str(store.attrs.get("kind"))
    finally:
        store.close()


class _LazySource(abc.ABC):
    """Rows opened read-only, lazily, once per process: what the datasets hold.

    Only ``path``, ``kind`` and ``storage_options`` (plus what a subclass adds) cross a process
    boundary; each process (a DataLoader worker, fork or spawn) opens its own handle on first use
    (:meth:`_open`), and a forked copy never shares memory maps, file handles or event loops with
    its parent.  A handle the user passed is used as is in the process that made the dataset.
    """

    path: str | None
    kind: str
    storage_options: dict[str, Any] | None

    def __init__(self, given: Any) -> None:
        self._pid = os.getpid()
        self._buf: Any = given
        self._owned = given is None

    @abc.abstractmethod
    def _open(self) -> Any:
        """This process's own read-only handle (called once per process)."""

    @property
    def buffer(self) -> Any:
        """This process's read-only handle (opened on first use, reopened after a fork)."""
        if self._buf is not None and self._pid != os.getpid():
            self._buf, self._owned = None, True
        if self._buf is None:
            self._buf = self._open()
            self._pid = os.getpid()
        return self._buf

    @property
    def is_trajectory(self) -> bool:
        """Whether the rows are :class:`~trajstore.TrajectoryReplayBuffer` steps."""
        return self.kind == "TrajectoryReplayBuffer"

    def close(self) -> None:
        """Close the handle this source opened in this process; one it was given stays open."""
        if self._buf is not None and self._owned and self._pid == os.getpid():
            self._buf.close()
        self._buf = None

    def __getstate__(self) -> dict[str, Any]:
        if self.path is None:
            raise TypeError("a dataset over an in-memory buffer (cache_path=None) cannot be pickled; "
                            "use num_workers=0 or create the buffer with a cache_path")
        state = dict(self.__dict__)
        state["_buf"] = None  # only the path and options cross the process boundary
        state["_owned"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class BufferSource(_LazySource):
    """Where the rows come from: a store path (opened read-only, lazily, once per process) or a buffer.

    Parameters
    ----------
    source : str, os.PathLike or StoredBuffer
        A store path or URL, or an open buffer.  A writer buffer is flushed first, so worker
        processes (which open the store read-only by path) see every row written so far.
    storage_options : dict, optional
        fsspec options for a URL (taken from the buffer when one is given).
    """

    def __init__(self, source: Any, storage_options: dict[str, Any] | None = None) -> None:
        if isinstance(source, StoredBuffer):
            buf = source
            if not buf.read_only:
                buf.flush()
            super().__init__(buf)
            self.path = buf.cache_path
            # A subclass (a store opened in place, open_diffusion_policy) is reopened by its own load_from.
            self.kind = next((k for k, c in _KINDS.items() if isinstance(buf, c)), type(buf).__name__)
            self._cls: type[StoredBuffer] | None = type(buf)
            self.storage_options = storage_options if storage_options is not None else buf.storage_options
        else:
            super().__init__(None)
            self.path = os.fspath(source)
            self.storage_options = storage_options
            self.kind = _store_kind(self.path, storage_options)
            self._cls = None
        if self.kind not in _KINDS:
            raise NotATrajstoreError(f"{self.path!r}: unsupported store kind {self.kind!r}; the datasets read "
                                     f"{' and '.join(_KINDS)} stores")

    def _open(self) -> StoredBuffer:
        if self.path is None:
            raise BadArgumentError("an in-memory buffer (cache_path=None) cannot be opened in another process; "
                                   "use num_workers=0 or a store path")
        cls = self._cls if self._cls is not None else _KINDS[self.kind]
        return cls.load_from(self.path, read_only=True, storage_options=self.storage_options)  # type: ignore[attr-defined]


class ShardedSource(_LazySource):
    """Where the rows come from when they are a sharded dataset: its root path, or an
    :func:`~trajstore.shards.open_sharded` view (used as is in this process); every other process
    opens its own view of the root."""

    def __init__(self, source: Any, storage_options: dict[str, Any] | None = None) -> None:
        if isinstance(source, ShardedDataset):
            super().__init__(source)
            self.path = source.path
            self.storage_options = storage_options if storage_options is not None else source.storage_options
        else:
            super().__init__(None)
            self.path = os.fspath(source)
            self.storage_options = storage_options
        self.kind = self.buffer.kind

    def _open(self) -> ShardedDataset:
        assert self.path is not None  # a sharded dataset always has a root
        return open_sharded(self.path, storage_options=self.storage_options)


def make_source(source: Any, storage_options: dict[str, Any] | None = None) -> BufferSource | ShardedSource:
    """The source of a dataset's rows: a :class:`ShardedSource` for a sharded dataset (its root
    path, or :func:`~trajstore.shards.open_sharded`'s view), else a :class:`BufferSource`."""
    if isinstance(source, ShardedDataset) or is_sharded_root(source, storage_options):
        return ShardedSource(source, storage_options)
    return BufferSource(source, storage_options)


class FieldSelection:
    """Which leaves of a buffer a dataset reads, and how they are assembled into output values.

    ``fields`` are ``/``-separated paths: for a trajectory buffer relative to ``step_data``
    (``"obs"``, ``"obs/pos"``) or, for per-episode values, starting with ``episode_data/``
    (``"episode_data/return"``); for a ReplayBuffer relative to its space.  ``None``: every
    top-level step field (the whole space of a non-Dict buffer as ``"data"``).
    """

    def __init__(self, buf: StoredBuffer, fields: Sequence[str] | str | None) -> None:
        # (a sharded dataset of trajectory stores says so by its kind)
        traj = isinstance(buf, TrajectoryReplayBuffer) or getattr(buf, "kind", None) == "TrajectoryReplayBuffer"
        step_space = buf.step_space if traj else buf.single_space  # type: ignore[attr-defined]
        if fields is None:
            import gymnasium

            fields = list(step_space.spaces) if isinstance(step_space, gymnasium.spaces.Dict) else [""]
        elif isinstance(fields, str):
            fields = [fields]
        self.names: list[str] = []
        self.plans: list[ValuePlan] = []
        self.leaf_ids: list[list[int]] = []  # per field: leaves of the buffer's space
        self.episode: list[bool] = []
        for name in fields:
            keys: list[Any] = [k for k in name.split("/") if k]
            is_ep = traj and keys[:1] == ["episode_data"]
            if traj and not is_ep:
                keys = ["step_data", *keys]
            if is_ep and buf.episode_space is None:  # type: ignore[attr-defined]
                raise UnknownFieldError(f"{buf.cache_path}: no field {name!r}: this store has no episode data; "
                                        f"its fields are {_field_list(buf, traj)}")
            keys = _tuple_keys(buf, traj, name, keys)
            space = subspace(buf.single_space, keys)
            prefix = tuple(keys)
            ids = [j for j, leaf in enumerate(leaves(buf.single_space)) if leaf.path[: len(prefix)] == prefix]
            self.names.append(name or "data")
            self.plans.append(ValuePlan(space))
            self.leaf_ids.append(ids)
            self.episode.append(is_ep)

    @property
    def step_leaves(self) -> list[int]:
        """Leaves of the buffer's space read per row (every step field), in field order."""
        return [j for ids, ep in zip(self.leaf_ids, self.episode) if not ep for j in ids]

    @property
    def episode_leaves(self) -> list[int]:
        """Leaves of the buffer's space read per episode (``episode_data/...`` fields), in field order."""
        return [j for ids, ep in zip(self.leaf_ids, self.episode) if ep for j in ids]

    def assemble(self, step_arrays: list[np.ndarray], ep_arrays: list[np.ndarray], out: Any) -> dict[str, Any]:
        """``{name: value}`` from the arrays of :attr:`step_leaves` and :attr:`episode_leaves` (in order)."""
        it_s, it_e = iter(step_arrays), iter(ep_arrays)
        result = {}
        for name, plan, ids, ep in zip(self.names, self.plans, self.leaf_ids, self.episode):
            src = it_e if ep else it_s
            result[name] = plan.from_arrays([out(next(src)) for _ in ids])
        return result


def _field_list(buf: StoredBuffer, traj: bool) -> str:
    """The field names a dataset accepts for ``buf``: every leaf as a ``/``-path (any prefix of
    one is a field too), for the error that names an unknown field."""
    names = []
    for leaf in leaves(buf.single_space):
        path = list(leaf.path)
        if traj and path[:1] == ["step_data"]:
            path = path[1:]
        names.append("/".join(map(str, path)))
    if names == [""]:
        return "none by name: each row is one value, read it with fields=None"
    listed = ", ".join(repr(n) for n in names if n)
    return listed + " (a '/'-prefix of one selects its subtree)" if any("/" in n for n in names) else listed


def _tuple_keys(buf: StoredBuffer, traj: bool, name: str, keys: list[Any]) -> list[Any]:
    """Check ``keys`` (the parts of field ``name``) against the buffer's space, turning digit
    keys that index a Tuple space into ints.

    Raises
    ------
    UnknownFieldError
        A key the space does not have; the message lists the fields the store has.
    """
    import gymnasium

    space, out = buf.single_space, []
    for k in keys:
        if isinstance(space, gymnasium.spaces.Tuple) and str(k).isdigit() and int(k) < len(space.spaces):
            k = int(k)
        elif not (isinstance(space, gymnasium.spaces.Dict) and k in space.spaces):
            raise UnknownFieldError(f"{buf.cache_path}: no field {name!r} in this store; its fields are "
                                    f"{_field_list(buf, traj)}")
        out.append(k)
        space = space[k]
    return out
