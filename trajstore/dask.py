"""Dask arrays over trajstore columns: ``to_dask(buffer.get_column("obs"))``.

The array holds the committed rows of the column when it is made; its chunks follow the
store's chunks (one dask chunk never spans two stored chunks), so a task reads each stored
chunk once.  Tasks carry only the store path, options and row range: every worker process
opens the store read-only itself (once per process), so the array computes on a
``dask.distributed`` cluster as long as the workers can reach the path (shared filesystem or
object storage with ``storage_options``).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np

from trajstore.buffers.base import StoredBuffer
from trajstore.errors import BadArgumentError, ConcurrentWriteError
from trajstore.buffers.replay import ReplayBuffer
from trajstore.spaces import ValuePlan
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.buffers.views import BatchBase, ColumnView

__all__ = ["to_dask"]

_KINDS = {"ReplayBuffer": ReplayBuffer, "TrajectoryReplayBuffer": TrajectoryReplayBuffer}
_OPEN: dict[tuple[Any, ...], tuple[int, StoredBuffer]] = {}
_LOCK = threading.Lock()


def _resolve(view: BatchBase) -> tuple[StoredBuffer, list[int]]:
    """The stored buffer under a chain of column views, and the view's leaves as leaves of that buffer."""
    leaves = list(range(len(view._plan.leaves)))
    node = view
    while isinstance(node, ColumnView):
        leaves = [node._leaf_map[j] for j in leaves]
        node = node.parent
    if not isinstance(node, StoredBuffer):
        raise BadArgumentError(f"to_dask needs a buffer or a column view of one (possibly nested); got {type(node).__name__} "
                        "in the chain (take the rows you need from the dask array instead: arr[lo:hi])")
    return node, leaves


def _field_of(buf: StoredBuffer, leaf: int) -> Any:
    if isinstance(buf, TrajectoryReplayBuffer):
        src, f = buf._src[leaf]
        if src != "s":
            raise BadArgumentError("to_dask covers step columns; episode data has one row per episode, not per step "
                            "(read it with buffer.get_column(['episode_data', ...]) instead)")
        return buf._table.fields[f]
    return buf._table.fields[leaf]


def _chunk_bounds(start: int, end: int, capacity: int | None, C: int) -> tuple[int, ...]:
    """Sizes of consecutive logical blocks of rows [start, end) (absolute) that each lie in one stored chunk."""
    cuts = [start]
    a = start
    while a < end:
        phys = a if capacity is None else a % capacity
        to_chunk_end = C - phys % C
        if capacity is not None:
            to_chunk_end = min(to_chunk_end, capacity - phys)  # a ring wraps at its capacity
        a = min(a + to_chunk_end, end)
        cuts.append(a)
    return tuple(int(b - a) for a, b in zip(cuts[:-1], cuts[1:])) or (0,)


def _open_cached(kind: str, path: str, options_json: str, storage_options: dict[str, Any] | None) -> StoredBuffer:
    key = (kind, path, options_json)
    pid = os.getpid()
    with _LOCK:
        hit = _OPEN.get(key)
        if hit is not None and hit[0] == pid:
            return hit[1]
        buf = _KINDS[kind].load_from(path, read_only=True, storage_options=storage_options)
        _OPEN[key] = (pid, buf)
        return buf


def _read_block(*, src: Any, leaf: int, first: int, block_info: Any = None) -> np.ndarray:
    lo, hi = block_info[None]["array-location"][0]
    if isinstance(src, tuple):
        buf = _open_cached(*src)
    else:
        buf = src  # an in-memory buffer: only the threaded/synchronous schedulers can use it
    buf._sync()
    start = buf._table.state.start
    a_lo, a_hi = first + lo, first + hi
    if a_lo < start:
        raise ConcurrentWriteError(f"rows [{a_lo}, {a_hi}) of {buf.cache_path!r} were evicted since the dask array was made")
    rows = np.arange(a_lo - start, a_hi - start, dtype=np.int64)
    return buf._read_rows(rows, [leaf])[0]


def to_dask(view: BatchBase) -> Any:
    """A dask array of the committed rows of a single-leaf column view (or buffer); a view of a
    Dict/Tuple sub-space gives the same nesting of dask arrays.

    Chunks along axis 0 are aligned with the store's chunk rows (a ring's wrap point included);
    the other axes are one chunk.  A writer's rows not yet committed are not included.
    """
    import dask.array as da
    from dask.base import tokenize

    buf, leaves = _resolve(view)
    buf._sync()
    head = buf._store.committed
    st = head.tables[buf._table.name]
    start, end = st.start, st.end
    if buf.cache_path is not None:
        opts = buf._open_args.get("storage_options")
        src: Any = (type(buf).__name__, buf.cache_path, json.dumps(opts, sort_keys=True, default=repr), opts)
    else:
        src = buf
    arrays = []
    for leaf in leaves:
        field = _field_of(buf, leaf)
        spec = field.spec
        chunks = (_chunk_bounds(start, end, buf._table.capacity, field.C), *((s,) for s in spec.row_shape))
        name = "trajstore-" + tokenize(buf.cache_path, spec.array_path, start, end, head.generation, head.epoch,
                                       id(buf) if buf.cache_path is None else 0)
        arr = da.map_blocks(_read_block, dtype=spec.dtype, chunks=chunks, name=name, meta=np.empty((0,) * (len(spec.row_shape) + 1), spec.dtype),
                            src=src, leaf=leaf, first=start)
        arrays.append(arr)
    return ValuePlan(view.single_space).from_arrays(arrays)
