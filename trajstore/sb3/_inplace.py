"""Observations of ``ZarrReplayBuffer.add`` stored once, straight into the writer's mapping of
their chunk files, instead of staged in RAM and written from there.

``add`` fills row ``n`` of a :class:`~trajstore.core.stager.RowStager`'s buffers and the stager
hands a block of rows to the table (``Table.extend``), which stores each field's block.  For an
(84,84,4) frame pair that is two copies of every frame: into the staging block, then (``pwrite``)
into the page cache.  :class:`InPlaceRows` points the stager's observation buffers at the rows
of the chunk files the block will be stored in (``MappedField.prepare_rows``: mapped, pages
faulted in for writing in one call), so ``add`` stores each frame once, and the hand-over copies
nothing for those fields (``MappedField.write`` sees the rows themselves).  The hand-over is the
same call as before (the table counts the rows, listeners run, commits name them), as are the
owner's drains before every read and commit.

Rows of a block are stored before it is handed over, where the stager stored them at the hand-over.
So before a block starts, the rows its slots hold must be out of the commit record:
:meth:`InPlaceRows.begin` commits a record that no longer counts them
(``Table.free_slots``, docs/design.md 3.2, the same call the hand-over makes for its own
rows); the hand-over's own eviction then finds nothing to do.  Until the hand-over every commit
is preceded by a drain, so no record counts a slot being written; rows stored but never handed
over (a SIGKILL) lie beyond the record's end.

Observations with rows smaller than :data:`MIN_ROW_BYTES` stay staged: the copy saved is small.
The staged path also stays wherever rows cannot be written in place: fields that are not memory-mapped
(compressed, remote, ``TRAJSTORE_NO_MMAP``), kernels without ``MADV_POPULATE_WRITE`` (before
Linux 5.14), an unbounded table, and a process forked from the writer (which must never store
into the mapping it shares with its parent).  It also takes the block after one that a read
handed over part-filled: a training loop that samples after every add (or every few) hands over
blocks of one to four rows, and preparing a block in place costs more than staging them.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import numpy as np

from trajstore.core.stager import RowStager
from trajstore.storage.fields.mapped import MappedField, in_place_writes_work

__all__ = ["InPlaceRows"]

#: Leaves with smaller rows stay staged: staging copies little of them, and preparing a block in
#: place (eviction check, views, madvise) costs 150-230 us per 256 rows.  Measured, tight loop of
#: adds to a 1e5-row ring: (17,) float32 observations 1.11-1.13x SB3 staged, 1.19-1.24x in place;
#: (84,84,4) uint8 frames 1.6-1.7x staged, 1.1-1.2x in place.
MIN_ROW_BYTES = 4096

#: Every live instance: a forked child turns them off (:func:`_after_fork`).
_LIVE: "weakref.WeakSet[InPlaceRows]" = weakref.WeakSet()


class InPlaceRows:
    """Leaves ``leaves`` of ``stager`` (memory-mapped fields of its table) stored in place.

    The owner calls :meth:`begin` whenever the stager starts a block (``stager.n == 0`` after
    ``room()``) and before it writes the block's first row.  Between blocks the stager's buffers
    may still view the rows of the last block handed over, so nothing but the owner's own adds
    may write rows through this stager.

    Parameters
    ----------
    stager : RowStager
        The stager of a ring table (``capacity`` set) whose ``leaves`` are :class:`MappedField`\\ s.
    leaves : sequence of int
        Indices into ``stager.bufs`` (and ``stager.table.fields``: the same order).
    """

    def __init__(self, stager: RowStager, leaves: Sequence[int]) -> None:
        self._st = stager
        self._table = stager.table
        self._leaves = list(leaves)
        self._own = [stager.bufs[i] for i in self._leaves]  # the stager's RAM buffers
        self._fields = [self._table.fields[i] for i in self._leaves]
        #: False once rows are staged for good (a kernel without MADV_POPULATE_WRITE, a fork).
        self.active = True
        self._end = 0  # absolute end of the block begun last
        _LIVE.add(self)

    @classmethod
    def of(cls, stager: RowStager, leaves: Sequence[int]) -> InPlaceRows | None:
        """An instance for the ``leaves`` of ``stager`` with rows of at least :data:`MIN_ROW_BYTES`,
        or None where no rows go in place (see the module docstring)."""
        t = stager.table
        if t.capacity is None or not in_place_writes_work():
            return None
        if not all(isinstance(t.fields[i], MappedField) and t.fields[i].writable for i in leaves):
            return None
        large = [i for i in leaves if t.fields[i].spec.row_bytes >= MIN_ROW_BYTES]
        return cls(stager, large) if large else None

    def begin(self) -> None:
        """The stager starts a block of ``stager.limit`` rows at the table's end: commit a record
        that no longer counts the rows in their slots, then point the stager's buffers at those
        slots (a leaf whose rows cannot be viewed in place keeps its own buffer for this block).
        The block is staged instead when the last one was handed over before it was full.

        Raises what the eviction commit or preparing the rows raises (``StoreFullError``, ...),
        before any row is written, with the stager's own buffers in place.
        """
        st, t = self._st, self._table
        self._restore()
        lo, n, cap = t.state.end, st.limit, t.capacity
        if not self.active or lo < self._end:
            # A read handed the last block over part-filled (a training loop samples after every
            # add or every few): stage this one.  In place, each block costs an eviction check,
            # views and a madvise call (20-40 us after a sample(256) has evicted the caches), more
            # than staging saves on the one to four rows added between reads; a block that fills
            # up goes back to storing in place.
            self._end = lo + n
            return
        assert st.n == 0 and cap is not None
        p = t.free_slots(n)  # (a closed or read-only store raises here, as the hand-over would)
        views: list[np.ndarray | None] = []
        for f in self._fields:
            assert isinstance(f, MappedField)
            views.append(f.prepare_rows(p, p + n))
            if not in_place_writes_work():  # the kernel refused the advice: staged from now on
                self.active = False
                return
        for i, v in zip(self._leaves, views):
            if v is not None:
                st.bufs[i] = v
        self._end = lo + n

    def _restore(self) -> None:
        """Give the stager its own buffers back."""
        for i, b in zip(self._leaves, self._own):
            self._st.bufs[i] = b


def _after_fork() -> None:
    """In a forked child: stage rows (the child shares the parent's mappings, and a store there
    would land in the parent's files; its hand-over raises ``LockedError`` as before)."""
    for d in list(_LIVE):
        d._restore()
        d.active = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
