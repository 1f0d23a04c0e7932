"""A table: several fields (zarr arrays) whose rows form one ring (or one growing list).

The table applies docs/design.md's ring rules and the commit protocol for the rows it
writes; the :class:`trajstore.core.store.Store` it belongs to owns the commit record.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, Sequence, overload

import numpy as np

from trajstore.core.ring import contiguous_runs, physical
from trajstore.storage.fields.base import Field, gather_windows_by_rows
from trajstore.storage.head import Head, TableState

__all__ = ["Table", "TableOwner"]


class TableOwner(Protocol):
    """What a table needs of the store it belongs to (:class:`trajstore.core.store.Store`): the
    commit record, and the hooks of the commit protocol that its writes call."""

    committed: Head

    def check_writable(self) -> None:
        """Raise unless this process may write the store now."""

    def ensure_evicted(self, table: "Table", min_start: int, guard: int) -> None:
        """Commit a record that no longer counts rows before ``min_start`` before they are overwritten."""

    def commit(self, *, fsync: bool | None = None, state: dict[str, Any] | None = None) -> None:
        """Write a new commit record."""

    def buffer_state(self) -> dict[str, Any] | None:
        """The buffer state saved with the next commit record."""

    def after_write(self) -> None:
        """Rows were written (an interval commit may be due)."""

    def commit_due(self) -> bool:
        """``commit_interval`` seconds have passed since the last commit (staged rows are due)."""

    def metadata_changed(self) -> None:
        """A field grew: consolidated metadata must be rewritten."""



class Table:
    """Rows shared by ``fields``; ``capacity=None`` grows by doubling.

    Parameters
    ----------
    store : TableOwner
        Owner of the commit record (the :class:`~trajstore.core.store.Store`).
    name : str
        Key of this table in the commit record.
    capacity : int or None
        Ring size, or ``None`` for an unbounded table.
    fields : list of Field
        One per stored array, in the order callers pass data.
    """

    def __init__(self, store: TableOwner, name: str, capacity: int | None, fields: list[Field], state: TableState):
        self.store = store
        self.name = name
        self.capacity = capacity
        self.fields = fields
        self.state = state  # in-memory (the writer's latest; a reader's last refresh)
        self._mapped_upto: tuple[int, int, int] | None = None  # state for which reads are prepared
        # A ring evicts this many rows beyond what a write strictly needs, so a full ring
        # commits an eviction record once per `guard` rows rather than on every append; writes
        # go in blocks of at most `guard` rows, so a reader (or a crash) sees a full ring at
        # most about 2 * guard rows short (1/16 of the capacity, or 8,192 rows).
        self.guard = 1 if capacity is None else max(1, min(capacity // 32, 4096))
        # Called as listener(first_absolute_row, arrays) after every block of rows written, and
        # as listener() once at the end of every extend call (episode bookkeeping, eviction).
        self.listeners: list[Callable[..., Any]] = []
        self.extend_listeners: list[Callable[..., Any]] = []

    # -- sizes ---------------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Rows present in the in-memory state (``end - start``)."""
        return self.state.end - self.state.start

    @property
    def offset(self) -> int:
        """Physical row of logical row 0: ``start % capacity`` (0 for an unbounded table)."""
        return 0 if self.capacity is None else self.state.start % self.capacity

    @property
    def row_bytes(self) -> int:
        """Uncompressed bytes of one row over all fields (``FieldSpec.row_bytes`` summed): what
        sizes work done in row blocks, e.g. the steps of ``extend_from``."""
        return sum(f.spec.row_bytes for f in self.fields)

    # -- writing -------------------------------------------------------------------------
    def extend(self, arrays: Sequence[np.ndarray], n: int) -> None:
        """Append ``n`` rows; ``arrays[j]`` has shape (n, *row_shape of field j).

        The in-memory state only ever names rows already written, so a commit at any point
        (the eviction records of a ring, a rewrite by a listener) names written rows only.
        """
        if n == 0:
            return
        self.store.check_writable()  # e.g. a process forked from the writer: never write its files
        st = self.state
        cap = self.capacity
        if cap is None:
            if st.end + n > st.allocated:
                self._grow(st.end + n)
            self.match_allocation()
            self._write_block(arrays, n)
        else:
            eager = n >= 2 * cap
            if eager:
                # Only the last `capacity` rows of the batch survive and every old row goes: the
                # skipped rows are never written (so they are never counted), the ring is committed
                # empty, then refilled and committed block by block.  A smaller batch is written
                # whole, so the ring stays full (old rows evicted as they are overwritten).
                skip = n - cap
                self.store.ensure_evicted(self, st.end + skip, 0)
                arrays = [a[skip:] for a in arrays]
                n = cap
                st.end += skip
                st.start = max(st.start, st.end)
            for pos in range(0, n, self.guard):
                m = min(self.guard, n - pos)
                self.free_slots(m)
                self._write_block([a[pos : pos + m] for a in arrays], m)
                if eager:
                    self.store.commit(state=self.store.buffer_state())
        for listener in self.extend_listeners:
            listener()
        self.store.after_write()

    def free_slots(self, n: int) -> int:
        """Make the ring slots of the next ``n`` rows (at most :attr:`guard`) writable: refuse a
        closed or read-only store, and commit a record that no longer counts the rows those slots
        hold (:meth:`StoreCommits.ensure_evicted <trajstore.core.commit.StoreCommits.ensure_evicted>`),
        before any of them is overwritten.  Returns the physical row of the first slot.

        :meth:`extend` calls it per block; a writer that stores rows into their slots itself (the
        SB3 buffers' observations, :mod:`trajstore.sb3._inplace`) calls it before it starts a block.
        """
        cap = self.capacity
        assert cap is not None, "free_slots is for rings"
        self.store.check_writable()
        end = self.state.end
        self.store.ensure_evicted(self, end + n - cap, self.guard)
        return end % cap

    def _write_block(self, arrays: Sequence[np.ndarray], n: int) -> None:
        """Write ``n`` rows after the last one (slots already free), count them, tell listeners."""
        st, cap = self.state, self.capacity
        lo, hi = st.end, st.end + n
        if cap is not None and hi - cap > st.start:
            # The slots about to be written stop holding their old rows now: should a write fail
            # part-way, no later commit may count those rows (their fields could disagree).
            st.start = hi - cap
        for phys_lo, off, m in contiguous_runs(lo, hi, cap):
            for f, a in zip(self.fields, arrays):
                f.write(phys_lo, a[off : off + m])
        st.end = hi
        for listener in self.listeners:
            listener(lo, arrays)

    def end_run(self, row: int) -> None:
        """An episode ends before absolute row ``row`` (an unbounded table: physical too): each
        field is told (:meth:`Field.end_run <trajstore.storage.fields.base.Field.end_run>`)."""
        for f in self.fields:
            f.end_run(row)

    def flush(self, fsync: bool, evicting_to: int | None = None, seal: bool = True) -> int:
        """Write buffered rows out (compressed fields keep dirty chunks in RAM); returns the end
        (absolute) of the rows now in the store's files.

        For a ring's eviction record (``evicting_to``: the start it will name), a compressed field
        keeps the chunk it is filling, so a ring that commits every ``guard`` rows writes each
        chunk once per lap instead of once per record; the record then ends at that chunk's first
        row, unless that would leave the ring less than half full.  A chunk that holds the whole
        ring is never held: the writer never leaves it, so its file would keep rows laps old behind
        the write position, which the record counts (a SIGKILL would leave them as committed rows).

        A video field keeps the frames of the episode being recorded in memory unless ``seal``
        (its ``open_from``): the end returned then stops at that episode's first row.
        """
        end = self.state.end
        holds: list[int | None] = [None] * len(self.fields)
        if evicting_to is not None and self.capacity is not None:
            p, cap = end % self.capacity, self.capacity
            held = [(j, p // f.C, p % f.C) for j, f in enumerate(self.fields)
                    if f.keeps_partial_chunk and p % f.C and f.C < cap]
            short = max((r for _j, _k, r in held), default=0)
            committed = self.store.committed.tables[self.name].end  # never named less than before
            if held and end - short >= committed and end - short - evicting_to >= self.capacity // 2:
                for j, k, _r in held:
                    holds[j] = k
                end -= short
        if seal and self.capacity is None:
            self.end_run(self.state.end)  # the episode being recorded goes out as it is
        for f, hold in zip(self.fields, holds):
            f.flush(fsync, hold)
        opens = [f.open_from for f in self.fields if f.open_from is not None]
        if opens:  # (only unbounded tables hold rows: their physical rows are absolute)
            end = min(end, *opens)
        return end

    def _grow(self, needed: int) -> None:
        new = max(self.state.allocated * 2, needed, 1)
        new = -(-new // max(f.C for f in self.fields)) * max(f.C for f in self.fields)
        for f in self.fields:
            f.grow(new)
        self.store.metadata_changed()
        self.state.allocated = new  # only once readers' metadata says so (else grown again next time)

    def match_allocation(self) -> None:
        """Grow this process's view of the arrays after another process grew the table (before
        chunks a commit record names are mapped: they may lie past the old reservation)."""
        for f in self.fields:
            if f.allocated < self.state.allocated:
                f.grow(self.state.allocated)

    # -- reading -------------------------------------------------------------------------
    def prepare_reads(self) -> None:
        """Map chunk files of all committed rows (once per state change, not per read)."""
        st = self.state
        key = (st.start, st.end, st.allocated)
        if self._mapped_upto == key:
            return
        self.match_allocation()
        for f in self.fields:
            for phys_lo, _off, m in contiguous_runs(st.start, st.end, self.capacity):
                f.ensure_mapped(phys_lo, phys_lo + m, create=False)
        self._mapped_upto = key

    @overload
    def physical(self, logical: int) -> int: ...
    @overload
    def physical(self, logical: np.ndarray) -> np.ndarray: ...
    def physical(self, logical: np.ndarray | int) -> np.ndarray | int:
        """Physical rows of logical rows ``logical`` (int, or an int64 array of any shape) under
        the in-memory state."""
        return physical(logical, self.state.start, self.capacity)

    def gather(self, logical: np.ndarray, which: Sequence[int]) -> list[np.ndarray]:
        """Copies of logical rows ``logical`` (B,) of the fields ``which``."""
        self.prepare_reads()
        st, cap = self.state, self.capacity
        if cap is not None and st.start % cap + st.end - st.start > cap:
            phys = (logical + st.start) % cap  # the rows wrap past the ring's last slot
        else:
            # No wrap (an unbounded table, or a ring whose rows lie in order from slot start % cap):
            # a shift, without the modulo; none at all from slot 0 (fields never change ``phys``).
            off = st.start if cap is None else st.start % cap
            phys = logical + off if off else logical
        return [self.fields[j].gather(phys) for j in which]

    def gather_windows(self, first: np.ndarray, length: int, which: Sequence[int]) -> list[np.ndarray]:
        """Copies of ``length`` consecutive logical rows from each of ``first`` (B,), every window
        inside ``[0, count)``: one (B, length, ...) array per field of ``which``."""
        self.prepare_reads()
        phys = np.asarray(self.physical(first))
        if self.capacity is None or not (wrap := phys > self.capacity - length).any():
            return [self.fields[j].gather_windows(phys, length) for j in which]
        straight = np.where(wrap, 0, phys)  # windows crossing the wrap point are read row by row below
        out = []
        for j in which:
            f = self.fields[j]
            a = f.gather_windows(straight, length)
            a[wrap] = gather_windows_by_rows(f, phys[wrap], length, self.capacity)
            out.append(a)
        return out

    def read_row(self, i: int, which: Sequence[int]) -> list[np.ndarray]:
        """Copy of logical row ``i`` (one unbatched row per field)."""
        self.prepare_reads()
        p = self.physical(i)
        return [self.fields[j].read_range(p, p + 1)[0, ...] for j in which]  # [0, ...]: 0-d arrays, not scalars

    def read_contiguous(self, lo: int, hi: int, which: Sequence[int], copy: bool = True) -> list[np.ndarray]:
        """Copies of logical rows ``[lo, hi)`` without building an index array; ``copy=False``:
        read-only views of mapped files where the rows lie in one chunk (see ``Field.read_range``)."""
        self.prepare_reads()
        runs = contiguous_runs(self.state.start + lo, self.state.start + hi, self.capacity)
        out = []
        for j in which:
            f = self.fields[j]
            if not runs:
                out.append(np.zeros((0, *f.spec.row_shape), f.spec.dtype))
                continue
            parts = [f.read_range(p, p + m, copy) for p, _o, m in runs]
            out.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        return out

    # -- rewriting committed rows (staged, crash-atomic) ---------------------------------
    def rewrite_plan_set(self, logical: np.ndarray, arrays: Sequence[np.ndarray],
                         which: Sequence[int]) -> Iterator[tuple[Field, int, np.ndarray]]:
        """Yield ``(field, chunk, new_chunk_data)`` for setting rows ``logical`` of fields ``which``."""
        self.prepare_reads()
        phys = np.asarray(self.physical(logical))
        for j, a in zip(which, arrays):
            f = self.fields[j]
            ks = phys // f.C
            for k in np.unique(ks).tolist():
                sel = ks == k
                yield f, k, f.edited_chunk(k, phys[sel] - k * f.C, values=a[sel])

    def rewrite_plan_remove(self, logical: np.ndarray) -> Iterator[tuple[Field, int, np.ndarray]]:
        """Yield ``(field, chunk, new_chunk_data)`` that delete rows ``logical`` and move later rows up.

        Sources are read from the current (not yet replaced) chunks, one destination chunk
        at a time, so memory stays bounded by a chunk per field.
        """
        self.prepare_reads()
        remove = np.unique(logical)
        if remove.size == 0:
            return
        keep = np.ones(self.count, dtype=bool)
        keep[remove] = False
        first = int(remove[0])
        src = np.flatnonzero(keep[first:]) + first  # logical sources of new rows first.. in order
        new_count = self.count - remove.size
        dst = np.arange(first, new_count)
        dst_phys = np.asarray(self.physical(dst))
        src_phys = np.asarray(self.physical(src))
        for f in self.fields:
            ks = dst_phys // f.C
            for k in np.unique(ks).tolist():
                sel = ks == k
                yield f, k, f.edited_chunk(k, dst_phys[sel] - k * f.C, src=src_phys[sel])
