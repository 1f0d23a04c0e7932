"""Where a :class:`~trajstore.sampling.prioritized.PrioritizedSampler` keeps its priorities: a
*sidecar store* inside the buffer's folder (``trajstore.priorities/``), an ordinary trajstore
ReplayBuffer store of one float32 row per buffer row, numbered with the buffer's absolute row
numbers; its commit record's state says which numbering (``main_epoch``) and the largest priority
(``max_priority``).  The decision and its rules are in the sampler module's docstring; this module
opens, reads and writes that store, and treats it as input like any store: a link or a non-folder
in its place is refused, damaged contents are replaced by a writer and ignored by a reader, and
stored values that are not finite and >= 0 are never used.
"""

from __future__ import annotations

import math
import os
import stat
import time
import warnings
from typing import Any, Callable

import numpy as np

from trajstore.core.store import Store, TableSpec
from trajstore.errors import ConcurrentWriteError, DamagedStoreError, NotATrajstoreError, StoreNotFoundError
from trajstore.sampling.source import SAMPLE_ATTEMPTS
from trajstore.spaces import space_to_json
from trajstore.storage.fields.layout import make_field_spec
from trajstore.storage.keys import PRIORITIES_DIR

__all__ = ["PriorityStore", "sidecar_url"]

#: The sidecar's table and field (a ReplayBuffer store of one float32 per row).
_TABLE = "step_data"
#: Rows per sidecar chunk (64 KiB of float32): a flush rewrites only the chunks holding changes.
SIDE_CHUNK_ROWS = 16384
#: A reader that found no sidecar looks for one again at most this often (seconds).
SIDE_RECHECK_S = 1.0


def sidecar_url(buffer: Any) -> str | None:
    """Where the buffer's sidecar lives: None for in-memory buffers and ``.zip`` files."""
    path = buffer.cache_path
    if path is None:
        return None
    p = os.fspath(path)
    if "://" in p or "::" in p:
        return p.rstrip("/") + "/" + PRIORITIES_DIR
    if os.path.isdir(p):
        return os.path.join(p, PRIORITIES_DIR)
    return None  # a .zip (read-only, written whole by dumps): no sidecar


def _not_a_folder(url: str) -> str | None:
    """Why the local sidecar ``url`` must not be opened: it is a link (a tampered store could
    point it anywhere, and a writer would write, or erase and recreate, what it points to) or
    something other than a folder.  None: a folder, or nothing there yet, or not a local path."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url or "::" in url:
        return None  # object stores have no links
    try:
        st = os.lstat(url)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return "is a link, which trajstore never follows out of a store"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    return None


class PriorityStore:
    """The sidecar store of one buffer's priorities, opened lazily.

    Parameters
    ----------
    buffer : ReplayBuffer or TrajectoryReplayBuffer
        Gives ``cache_path`` and ``storage_options``.
    writable : bool
        A writer's sampler (creates, rewrites and commits the sidecar); else read-only.
    capacity : int or None
        The buffer's ring capacity (None: unbounded).
    state : callable
        The commit-record state a writer's commits carry (``main_epoch``, ``max_priority``).
    """

    def __init__(self, buffer: Any, writable: bool, capacity: int | None,
                 state: Callable[[], dict[str, Any]]) -> None:
        self.url = sidecar_url(buffer)
        self.writable = writable
        self._options = buffer.storage_options
        self._capacity = capacity
        self._state = state
        self.store: Store | None = None
        self.seen = 0  # generation of the record the sampler's values came from
        self._looked = -math.inf

    def open(self, create: bool) -> Store | None:
        """The sidecar store, opened (writers: created when ``create``) if it is not yet; None
        where there is none (yet) or it must not be read.

        Raises
        ------
        DamagedStoreError
            (writers) Its place holds a link or something other than a folder.
        """
        if self.store is not None or self.url is None:
            return self.store
        if not create and time.monotonic() - self._looked < SIDE_RECHECK_S:
            return None
        self._looked = time.monotonic()
        refused = _not_a_folder(self.url)
        if refused is not None:
            msg = f"{self.url} {refused}; remove it so that priorities can be stored there"
            if self.writable:
                raise DamagedStoreError(msg)
            warnings.warn(f"{msg}. Every row counts as max_priority", stacklevel=4)
            self.url = None  # never looked at again
            return None
        overwrite = False
        try:
            self.store = Store.open(self.url, "ReplayBuffer", read_only=not self.writable,
                                    multiprocessing=False, storage_options=self._options, options={})
        except StoreNotFoundError:
            if not (create and self.writable):
                return None
        except (DamagedStoreError, NotATrajstoreError) as e:
            # A writer killed while it created the sidecar (or a damaged one): priorities are
            # hints, so a writer starts a new sidecar and a reader samples without them.
            if not self.writable:
                warnings.warn(f"{self.url}: the stored priorities cannot be read ({e}); every row counts "
                              "as max_priority", stacklevel=4)
                return None
            if not create:
                return None
            warnings.warn(f"{self.url}: the stored priorities cannot be read ({e}); they are written anew",
                          stacklevel=4)
            overwrite = True
        if self.store is None:
            self.store = self._create(overwrite)
        if self.writable:
            self.store.state_provider = self._state
        self.seen = -1  # values not read yet
        return self.store

    def _create(self, overwrite: bool) -> Store:
        assert self.url is not None
        remote = "://" in self.url and not self.url.startswith(("file://", "memory://"))
        # A ring evicts up to two `guard`s of rows (1/16 of its capacity) before it must: a
        # sidecar ring 1/8 larger than the buffer's always keeps every row the buffer keeps.
        cap = None if self._capacity is None else self._capacity + self._capacity // 8 + 64
        spec = make_field_spec(_TABLE, (), np.dtype(np.float32), capacity=cap,
                               compressor="lz4" if remote else None, chunk_rows=SIDE_CHUNK_ROWS)
        from gymnasium.spaces import Box

        space = Box(0.0, np.inf, (), np.float32)
        return Store.create(self.url, "ReplayBuffer", [TableSpec(_TABLE, cap, [spec])],
                            {"spaces": {_TABLE: space_to_json(space)}}, storage_options=self._options,
                            overwrite=overwrite, multiprocessing=False, options={})

    def valid(self, epoch: int | None) -> bool:
        """Whether the stored rows are numbered as the buffer's are under ``epoch``."""
        return self.store is not None and self.store.committed.state.get("main_epoch") == epoch

    def max_priority(self) -> float | None:
        """The largest priority the last record names (None: none, or not a finite number > 0)."""
        m = self.store.committed.state.get("max_priority") if self.store is not None else None
        if isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) and m > 0:
            return float(m)
        return None

    def changed(self) -> bool:
        """A reader re-reads the record; True when a record other than the one last used is current."""
        if self.store is None and self.url is not None and not self.writable:
            if self.open(create=False) is None:
                return False
        elif self.store is not None and not self.writable:
            self.store.refresh()
        if self.store is None or self.seen == self.store.committed.generation:
            return False
        self.seen = self.store.committed.generation
        return True

    def read(self, lo: int, hi: int, epoch: int | None, default: float) -> np.ndarray:
        """Priorities of absolute rows ``[lo, hi)``: the stored ones where there are (finite and
        >= 0; the store is input like any), ``default`` elsewhere.  (hi - lo,) float32."""
        out = np.full(hi - lo, default, np.float32)
        side = self.store
        if side is None or hi <= lo or not self.valid(epoch):
            return out
        t = side.tables[_TABLE]
        for _ in range(SAMPLE_ATTEMPTS):
            gen = side.committed.generation
            a, b = max(lo, t.state.start), min(hi, t.state.end)
            vals = t.read_contiguous(a - t.state.start, b - t.state.start, [0])[0] if a < b else None
            if side.writable or not side.refresh() or side.committed.generation == gen:
                break
        else:
            raise ConcurrentWriteError(f"{self.url}: the priorities kept changing while they were read")
        if vals is not None:
            good = np.isfinite(vals) & (vals >= 0)
            out[a - lo : b - lo] = np.where(good, vals, np.float32(default))
        return out

    def write(self, epoch: int | None, main: tuple[int, int], restart: int, rows: np.ndarray, values: np.ndarray,
              tail: Callable[[np.ndarray], np.ndarray], fsync: bool | None) -> None:
        """Commit priorities (writers): ``values`` (K,) float32 of absolute ``rows`` (K,) where the
        store holds them, then rows up to the buffer's committed end, whose values ``tail(rows)``
        gives.

        Parameters
        ----------
        epoch : int or None
            The buffer's epoch (numbering of rows) the values follow.
        main : (int, int)
            The buffer's committed absolute rows ``[start, end)`` (end: at most the sampler's).
        restart : int
            Where the stored rows start over when they follow another epoch or none of ``main``.
        """
        side = self.open(create=True)
        assert side is not None
        t = side.tables[_TABLE]
        main_start, main_end = main
        if not self.valid(epoch) or t.state.end > main_end or t.state.end < main_start:
            # Renumbered rows (a new epoch), or every stored row gone: start over at the buffer's start.
            t.state.start = t.state.end = restart
            head = side._current_head()
            head.epoch += 1
            head.state = self._state()
            side._write_head(head)
        lo, hi = t.state.start, t.state.end
        keep = (rows >= lo) & (rows < hi)
        if keep.any():
            side.rewrite(t.rewrite_plan_set(rows[keep] - lo, [values[keep]], [0]), lambda: None)
        if main_end > t.state.end:
            new = np.arange(t.state.end, main_end, dtype=np.int64)
            t.extend([tail(new)], new.size)
        side.commit(fsync=fsync, state=self._state())
        self.seen = side.committed.generation

    def close(self) -> None:
        """Release the store (and a writer's lock)."""
        if self.store is not None:
            self.store.close()
            self.store = None
