"""A sharded dataset as the torch datasets' row source: picklable, opened lazily in each process.

The counterpart of :class:`trajstore.torch._source.BufferSource` for a dataset root: only the
path and the storage options cross a process boundary, and every process (each DataLoader
worker, fork or spawn) opens its own :func:`~trajstore.shards.open_sharded` view on first use.
"""

from __future__ import annotations

import os
from typing import Any

from trajstore.shards.dataset import ShardedDataset, open_sharded
from trajstore.shards.layout import ROOT_KEY, root_location

__all__ = ["ShardedSource", "is_sharded"]


def is_sharded(source: Any, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``source`` is a :class:`ShardedDataset` or the path of one (a root with
    ``trajstore.shards.json``); False for anything else, a single store included."""
    if isinstance(source, ShardedDataset):
        return True
    if not isinstance(source, (str, os.PathLike)):
        return False
    p = os.fspath(source)
    if "://" not in p and not os.path.isdir(p):
        return False
    try:
        return root_location(p, read_only=True, storage_options=storage_options).exists(ROOT_KEY)
    except Exception:  # not a folder or URL we can look into: BufferSource reports it
        return False


class ShardedSource:
    """Where a dataset's rows come from when they are a sharded dataset (see :class:`BufferSource
    <trajstore.torch._source.BufferSource>`, whose attributes it has)."""

    def __init__(self, source: Any, storage_options: dict[str, Any] | None = None) -> None:
        self._pid = os.getpid()
        if isinstance(source, ShardedDataset):
            self.path: str = source.path
            self.storage_options = storage_options if storage_options is not None else source.storage_options
            self._buf: ShardedDataset | None = source
            self._owned = False
        else:
            self.path = os.fspath(source)
            self.storage_options = storage_options
            self._buf = None
            self._owned = True
        self.kind = self.buffer.kind

    @property
    def buffer(self) -> ShardedDataset:
        """This process's view of every shard (opened on first use, reopened after a fork)."""
        if self._buf is not None and self._pid != os.getpid():
            self._buf, self._owned = None, True  # a forked copy shares no handles with its parent
        if self._buf is None:
            self._buf = open_sharded(self.path, storage_options=self.storage_options)
            self._pid = os.getpid()
        return self._buf

    @property
    def is_trajectory(self) -> bool:
        """Whether the shards are :class:`~trajstore.TrajectoryReplayBuffer` stores."""
        return self.kind == "TrajectoryReplayBuffer"

    def close(self) -> None:
        """Close the view this source opened in this process; one it was given stays open."""
        if self._buf is not None and self._owned and self._pid == os.getpid():
            self._buf.close()
        self._buf = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_buf"] = None  # only the path and options cross the process boundary
        state["_owned"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
