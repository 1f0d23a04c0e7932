"""The priorities of a buffer's live rows, in RAM, kept in step with the buffer and its sidecar:
what a :class:`~trajstore.sampling.prioritized.PrioritizedSampler` draws from.

:class:`LiveRows` holds one raw priority per *slot* (a ring's physical row, an unbounded buffer's
absolute row), the sum tree over their weights ``(priority + eps) ** alpha``, and which rows are
live: absolute rows ``[start, end)`` under the buffer's epoch (its numbering of rows).
:meth:`LiveRows.follow` catches all of it up with the buffer (rows appended or evicted, a new
epoch after a rewrite) and with the sidecar store (a newer record written by the writer's
sampler): new rows read their stored priority (``max_priority`` where none is stored), evicted
ones leave the tree.
"""

from __future__ import annotations

import numpy as np

from trajstore.sampling.priority_store import PriorityStore
from trajstore.sampling.source import RowSource
from trajstore.sampling.sumtree import SumTree

__all__ = ["LiveRows", "REBUILD_FRACTION"]

#: Rows added or evicted at once beyond this fraction of the tree rebuild it (O(n)) instead of
#: updating row by row (O(k log n)).
REBUILD_FRACTION = 0.125


class LiveRows:
    """Priorities and sum tree of the live rows of ``src``.

    Parameters
    ----------
    src : RowSource
        The buffer's rows.
    side : PriorityStore
        Where the priorities are stored.
    alpha, eps : float
        A slot's tree weight is ``(priority + eps) ** alpha``.

    Attributes
    ----------
    tree : SumTree
        Weights per slot (0 for slots without a live row).
    p : np.ndarray
        (tree.size,) float32 raw priority per slot (meaningful for live slots only).
    dirty : np.ndarray
        (tree.size,) bool: changed here since the sidecar last stored it.
    start, end : int
        The live rows, absolute ``[start, end)``.
    epoch : int or None
        The buffer's epoch they are numbered under (None before the first :meth:`follow`).
    max_priority : float
        The largest priority seen so far (what new rows get); 1.0 at first.
    """

    def __init__(self, src: RowSource, side: PriorityStore, alpha: float, eps: float) -> None:
        self.src, self.side = src, side
        self.alpha, self.eps = alpha, eps
        self.cap = src.capacity
        self.tree = SumTree(self.cap if self.cap is not None else max(1024, src.start + src.count))
        self.p = np.zeros(self.tree.size, np.float32)
        self.dirty = np.zeros(self.tree.size, bool)
        self.start = self.end = 0
        self.epoch: int | None = None
        self.max_priority = 1.0

    # -- numbering ------------------------------------------------------------------------------
    def slots(self, rows: np.ndarray) -> np.ndarray:
        """Slots of absolute ``rows`` (int64, any shape)."""
        return rows % self.cap if self.cap is not None else rows

    def logical(self, slots: np.ndarray) -> np.ndarray:
        """Logical rows (0 = the oldest live row) of live ``slots``."""
        if self.cap is None:
            return slots - self.start
        return (slots - self.start) % self.cap

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """Absolute rows of live ``slots``."""
        if self.cap is None:
            return slots.astype(np.int64)
        first = self.start % self.cap
        return self.start + (slots - first) % self.cap

    def weights(self, p: np.ndarray) -> np.ndarray:
        """Tree weights ``(p + eps) ** alpha`` of raw priorities ``p``, float64."""
        return np.power(p.astype(np.float64) + self.eps, self.alpha)

    # -- the sidecar ----------------------------------------------------------------------------
    def adopt_side_max(self) -> None:
        """``max_priority`` at least the one the sidecar's record names."""
        m = self.side.max_priority()
        if m is not None:
            self.max_priority = max(self.max_priority, m)

    def stored(self, lo: int, hi: int) -> np.ndarray:
        """Priorities of absolute rows ``[lo, hi)`` (``max_priority`` where none is stored)."""
        return self.side.read(lo, hi, self.epoch, self.max_priority)

    def tail(self, new: np.ndarray) -> np.ndarray:
        """Priorities of absolute rows ``new`` the sidecar does not hold yet, (K,) float32."""
        vals = np.full(new.size, self.max_priority, np.float32)
        alive = new >= self.start
        vals[alive] = self.p[self.slots(new[alive])]
        return vals

    # -- changes --------------------------------------------------------------------------------
    def set(self, rows: np.ndarray, p: np.ndarray) -> None:
        """Priorities ``p`` ((B,) float64) of absolute ``rows`` (B,); rows no longer live are skipped."""
        live = (rows >= self.start) & (rows < self.end)
        rows, p = rows[live], p[live]
        if rows.size:
            slots = self.slots(rows)
            self.p[slots] = p
            self.dirty[slots] = True
            self.tree.update(slots, self.weights(self.p[slots]))
            self.max_priority = max(self.max_priority, float(p.max()))

    def _ensure_room(self, end: int) -> None:
        if self.cap is None and end > self.tree.size:
            self.tree.grow(end)
            size = self.tree.size
            self.p = np.concatenate([self.p, np.zeros(size - len(self.p), np.float32)])
            self.dirty = np.concatenate([self.dirty, np.zeros(size - len(self.dirty), bool)])

    def _rebuild(self) -> None:
        """Tree weights from ``p`` for the live rows, O(n)."""
        w = np.zeros(self.tree.size, np.float64)
        if self.end > self.start:
            slots = self.slots(np.arange(self.start, self.end, dtype=np.int64))
            w[slots] = self.weights(self.p[slots])
        self.tree.build(w)

    def _reload(self) -> None:
        """Every live row's priority from the sidecar again (its record changed), keeping this
        process's own unwritten changes."""
        self.adopt_side_max()
        if self.end > self.start:
            slots = self.slots(np.arange(self.start, self.end, dtype=np.int64))
            stored = self.stored(self.start, self.end)
            mine = self.dirty[slots]
            self.p[slots] = np.where(mine, self.p[slots], stored)
        self._rebuild()

    def follow(self) -> None:
        """Catch up with the buffer (rows added and evicted, a new epoch) and with the sidecar
        (a newer record written by the writer's sampler)."""
        src = self.src
        src.sync()
        side_changed = self.side.changed()
        epoch = src.record.epoch
        start, end = src.start, src.start + src.count
        if epoch != self.epoch or start < self.start or end < self.end:
            # Rows were rewritten, removed or cleared (or this is the first look): renumbered.
            self.epoch = epoch
            self.start, self.end = start, end
            self._ensure_room(end)
            self.dirty[:] = False
            self.adopt_side_max()
            if end > start:
                self.p[self.slots(np.arange(start, end, dtype=np.int64))] = self.stored(start, end)
            self._rebuild()
            return
        if start == self.start and end == self.end and not side_changed:
            return
        self._ensure_room(end)
        gone = np.arange(self.start, min(start, self.end), dtype=np.int64)
        new = np.arange(max(self.end, start), end, dtype=np.int64)
        self.start, self.end = start, end
        gs, ns = self.slots(gone), self.slots(new)
        self.dirty[gs] = False
        self.dirty[ns] = False
        if side_changed:
            self._reload()
            return
        if new.size:
            self.p[ns] = self.stored(int(new[0]), end)
        if gone.size + new.size > REBUILD_FRACTION * self.tree.size:
            self._rebuild()
            return
        # A ring's new row in a freed slot: its weight comes last and wins.
        self.tree.update(np.concatenate([gs, ns]), np.concatenate([np.zeros(gone.size), self.weights(self.p[ns])]))
