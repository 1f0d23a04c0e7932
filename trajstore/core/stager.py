"""Single-row appends staged in RAM and handed to a :class:`~trajstore.core.table.Table` a block at a time.

Per-step ``append`` then costs a validation and one small copy per leaf; the table (writes, ring
bookkeeping, commits) runs once per block.  Owners drain the stager before every read and commit,
so staging is invisible except in what a crash can lose (rows never committed).

(Writing blocks of image rows from a background thread while the caller stages the next block was
measured and rejected: on 2 cores the add got slower, 42 -> 67 us for an (84,84,4) frame pair,
since the copy into the page cache is the bottleneck either way and the thread adds GIL handoffs.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from trajstore.core.table import Table

__all__ = ["RowStager"]

#: A block holds about this many bytes (16 to 256 rows).  Per-block costs (ring bookkeeping, one
#: ``pwrite`` per large field, small fields stored into their mappings) are spread over more rows
#: when blocks are bigger: an (84,84,4) frame pair's ``ZarrReplayBuffer.add`` took 26 us with
#: 1 MiB blocks (18 rows) and 22.5 us with 128-row blocks (docs/benchmarks.md).  16 MiB holds a
#: whole 256-row chunk of such pairs (see :meth:`RowStager.room` for why whole chunks matter).
STAGE_BYTES = 16 << 20


class RowStager:
    """Rows appended one at a time, collected in ``bufs`` (one array per leaf, ``rows`` rows each)
    and handed to ``table`` a block at a time.

    Writers call :meth:`room`, fill ``bufs[*][n]`` and call :meth:`added`; owners call
    :meth:`drain` before every read and commit (``pending`` says whether it is needed).  A
    writer outside the owning buffer gets the stager from it (``ReplayBuffer.row_stager``).

    An owner that keeps some leaves' values itself (the SB3 buffers hold actions, rewards and
    dones in RAM arrays anyway) may leave them unstaged and set :attr:`fill`: ``fill(bufs, n)``
    is called by every :meth:`drain` before the rows are handed over and must write rows
    ``[0, n)`` of those leaves, which are always the owner's last ``n`` appended rows (a drain
    that failed part-way keeps the newest rows staged, so this stays true).  A per-step copy
    per small leaf becomes one gather per leaf and block.
    """

    #: See the class docstring; None: every leaf is staged by the writer.
    fill: Callable[[list[np.ndarray], int], None] | None = None

    def __init__(self, table: Table, leaves: Sequence[tuple[tuple[int, ...], np.dtype]]) -> None:
        self.table = table
        row_bytes = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize for s, d in leaves) or 1
        rows = int(min(256, max(16, STAGE_BYTES // row_bytes)))
        if table.capacity is not None:
            rows = min(rows, table.guard)  # a ring's block is also its eviction step (Table.guard)
        self.bufs = [np.empty((rows, *s), d) for s, d in leaves]
        self.rows = rows
        self.n = 0
        #: Rows at which the block being staged is handed over (set by :meth:`room` at its first row).
        self.limit = rows
        # Blocks end where a chunk of the field with the largest rows ends (room()).
        self._chunk_rows = max(table.fields, key=lambda f: f.spec.row_bytes).C if table.fields else rows

    @property
    def pending(self) -> bool:
        """Rows are staged: a reader must :meth:`drain` first."""
        return bool(self.n)

    def room(self) -> None:
        """Make sure ``bufs[*][n]`` exists before a row is written there: after a failed drain (a
        full disk) the buffers may still be full, and the write is tried again first.

        A block's first row sets :attr:`limit` so the block ends where a chunk (of the field with
        the largest rows) or the ring ends: each block is then one ``pwrite`` per field, and a ring
        written step by step fills whole chunks with whole writes.  The kernel sizes page-cache
        folios by the writes that create them, so such a ring's chunks end up in 2 MiB folios,
        which a reader maps with one fault each and which ``pwrite`` fills faster on the next lap
        (blocks that straddled chunks left smaller folios at every block edge).
        """
        if self.n >= self.limit:
            self.drain()
        if self.n == 0:
            p, cap, c = self.table.state.end, self.table.capacity, self._chunk_rows
            if cap is not None:
                p %= cap
                self.limit = min(self.rows, c - p % c, cap - p)
            else:
                self.limit = min(self.rows, c - p % c)

    def added(self, *, commit_timer: bool = True) -> None:
        """One row was written into ``bufs[*][n]``: count it; hand the block over when it is
        full, or when the store's ``commit_interval`` says staged rows are due.

        Parameters
        ----------
        commit_timer : bool
            False: only a full block is handed over; the owner times commits itself.
            ``ZarrReplayBuffer.add`` does: it commits once ``commit_interval`` has passed since
            its oldest uncommitted add, where the store's timer (since the last commit) would
            hand over and commit the first add after every pause alone (3-10 ms on a loaded
            machine).
        """
        self.n += 1
        if self.n >= self.limit or (commit_timer and self.table.store.commit_due()):
            self.drain()

    def drain(self) -> None:
        """Hand the staged rows to the table.  If that fails (a full disk), the rows it did not
        write stay staged, so rows of ``append`` calls that returned are never dropped."""
        if self.n:
            n, end = self.n, self.table.state.end
            try:
                if self.fill is not None:
                    self.fill(self.bufs, n)
                self.table.extend([b[:n] for b in self.bufs], n)
            except BaseException:
                done = min(max(self.table.state.end - end, 0), n)  # rows written and counted
                for b in self.bufs:
                    b[: n - done] = b[done:n]
                self.n = n - done
                raise
            self.n = 0

    def discard(self) -> None:
        """Drop every staged row (``clear``)."""
        self.n = 0
