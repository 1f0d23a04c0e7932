"""Dask arrays over the committed rows of a :class:`~trajstore.sampling.source.RowSource`.

The array holds the rows committed when it is made; its chunks follow the store's chunks (one
dask chunk never spans two stored chunks, nor a ring's wrap point), so a task reads each stored
chunk once.  Tasks carry only the source's reopen recipe (its path and options) and a row
range: every worker process opens the store read-only itself (once per process), so the array
computes on a ``dask.distributed`` cluster as long as the workers can reach the path (shared
filesystem or object storage with ``storage_options``).  Secrets in ``storage_options``
(``key``, ``secret``, ``token``...) never enter the graph: it carries the other settings and a
reference (:func:`trajstore.storage.credentials.scrub`), which the process that made the graph
resolves to the full options (threaded and synchronous schedulers) and every other process to
the settings alone, its filesystem then taking credentials from that machine's environment,
AWS profile or instance role.  ``trajstore.dask.to_dask`` and ``view.to_dask()`` are the public
entry points.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from trajstore.errors import BadArgumentError, ConcurrentWriteError
from trajstore.sampling.source import RowSource, read_consistent
from trajstore.storage.credentials import resolve, scrub

__all__ = ["dask_arrays"]

# Sources reopened in this process, by recipe: (pid, source).  A forked worker opens its own.
_OPEN: dict[str, tuple[int, RowSource]] = {}
_LOCK = threading.Lock()


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


def _open_cached(key: str, recipe: tuple[Callable[..., RowSource], tuple[Any, ...]]) -> RowSource:
    pid = os.getpid()
    with _LOCK:
        hit = _OPEN.get(key)
        if hit is not None and hit[0] == pid:
            return hit[1]
        fn, args = recipe
        src = fn(*resolve(args))  # secrets: held by the process that made the graph, else from the environment
        _OPEN[key] = (pid, src)
        return src


def _read_block(*, src: Any, leaf: int, first: int, epoch: int, block_info: Any = None) -> np.ndarray:
    """Absolute rows ``first + [lo, hi)`` of the block, as the array's record numbered them
    (its ``epoch``): read consistently, or ConcurrentWriteError when they are no longer those rows."""
    lo, hi = block_info[None]["array-location"][0]
    if isinstance(src, tuple):  # (key, recipe): open the store in this process
        src = _open_cached(*src)
    a_lo, a_hi = first + lo, first + hi

    def read() -> np.ndarray:
        # Under the record read_consistent pins and checks again afterwards: rows a writer evicts
        # (and reuses the slots of) while they are read make it read again, and this raise then.
        if src.record.epoch != epoch:  # renumbered or changed in place: absolute rows name other rows
            raise ConcurrentWriteError(f"rows [{a_lo}, {a_hi}) of {src.name} were rewritten (set_at, remove_at, "
                                       "clear) since the dask array was made; make it again")
        start = src.start
        if a_lo < start:
            raise ConcurrentWriteError(f"rows [{a_lo}, {a_hi}) of {src.name} were evicted since the dask array was made")
        return src.read_rows(np.arange(a_lo - start, a_hi - start, dtype=np.int64), [leaf])[0]

    # (an in-memory source is used as it is: only threaded/synchronous schedulers can)
    return read_consistent(src, read)


def dask_arrays(src: RowSource, leaves: Sequence[int]) -> list[Any]:
    """One dask array per per-row leaf in ``leaves``: the rows committed now, (rows, *leaf.shape).

    Chunks along axis 0 are aligned with the store's chunk rows (a ring's wrap point included);
    the other axes are one chunk.  A writer's rows not yet committed are not included.  Tasks
    name rows by ``src``'s absolute rows under this record's epoch, so the source's numbering
    must mean the same rows in every process that reopens it (a store's does; a selection of
    episodes numbers its rows in its own process: ``EpisodeView.dask_leaves`` indexes its
    parent's arrays instead).  Computing a block whose rows a ring evicted, or that were
    rewritten since (a new epoch), raises ConcurrentWriteError.

    Raises
    ------
    BadArgumentError
        A leaf is not stored per row (episode data of a trajectory buffer).
    """
    import dask.array as da
    from dask.base import tokenize

    src.sync()
    record = src.record
    start, end = src.committed
    recipe = src.reopen
    if recipe is not None:  # the graph is pickled to the scheduler and workers: no secret travels in it
        recipe = (recipe[0], scrub(recipe[1]))
    task_src: Any = src if recipe is None else (json.dumps([src.name, repr(recipe)], sort_keys=True), recipe)
    arrays = []
    for leaf in leaves:
        field = src.leaf_field(leaf)
        if field is None:
            raise BadArgumentError("to_dask covers step columns; episode data has one row per episode, not per step "
                                   "(read it with buffer.get_column(['episode_data', ...]) instead)")
        spec = field.spec
        chunks = (_chunk_bounds(start, end, src.capacity, field.C), *((s,) for s in spec.row_shape))
        name = "trajstore-" + tokenize(src.name, spec.array_path, start, end, record.generation, record.epoch,
                                       id(src) if recipe is None else 0)
        meta = np.empty((0,) * (len(spec.row_shape) + 1), spec.dtype)
        # dask's map_blocks is not annotated
        arrays.append(da.map_blocks(_read_block, dtype=spec.dtype, chunks=chunks, name=name,  # type: ignore[no-untyped-call]
                                    meta=meta, src=task_src, leaf=leaf, first=start, epoch=record.epoch))
    return arrays
