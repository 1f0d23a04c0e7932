"""Where the sole writer of a raw field writes zeros so that the page cache holds 2 MiB folios.

The page cache keeps a write in folios as large as the write allows (ext4, XFS), and a reader maps
a 2 MiB folio (:data:`~trajstore.storage.fields._syscalls.HUGE`) with one fault and one TLB entry,
4 KiB pages one by one.  Rows arrive in pieces smaller than that: a ring's blocks (``Table.guard``
rows: 278 KiB of (17,) float32 rows) or single rows stored through the writer's mapping.  Left
alone they leave folios of 1 to 64 pages, and a reader of a 1e7-row store paid 2.5x a memmap's
page faults on its first calls and more page walks after (docs/performance-notes.md, "Vector reads
at 1e7 rows").  So the writer fills each 2 MiB piece of a chunk file it made with zeros before (or
with) the first rows that reach it: the whole piece becomes one folio.

Only where that changes no byte anyone reads: pieces of chunk files this process made (a new file
is all zeros) that no row has reached yet, and only in a store's only writer (several writer
processes, ``multiprocessing=True``, do not know what the others wrote).  The zeros are the fill
value, in bytes past every row written; their disk blocks are allocated first (``fallocate``) and
are the coming rows' own; a full disk skips the zeros, never the rows.  Only in a field whose rows
this process wrote already reach 2 MiB: a small store stays as small on disk as its rows (plus the
growth step of docs/format.md), and a large one allocates at most one piece per field ahead of them
(the chunk file being filled).

:class:`PieceFiller` keeps the bookkeeping and decides; :class:`~trajstore.storage.fields.mapped.MappedField`
writes: zeros around a large block in the block's own ``pwritev`` (:meth:`PieceFiller.around`),
whole pieces before small writes (:meth:`PieceFiller.pieces_to_fill`).
"""

from __future__ import annotations

import sys

import numpy as np

from trajstore.storage.fields import _syscalls

__all__ = ["FILL_FOLIOS", "PieceFiller", "zero_piece"]

#: Whether a sole writer fills the 2 MiB pieces of the chunk files it makes (scripts/probe_writer_folios.py
#: times writes both ways; scripts/probe_read_faults.py reads a store written without, ``raw-nofill``).
FILL_FOLIOS = True

_ZEROS: list[np.ndarray] = []  # (one array, made on first use)


def zero_piece() -> np.ndarray:
    """:data:`~trajstore.storage.fields._syscalls.HUGE` zero bytes, made once and never written:
    the allocator maps them untouched, so ``pwrite`` reads the kernel's one zero page over and over."""
    if not _ZEROS:
        _ZEROS.append(np.zeros(_syscalls.HUGE, np.uint8))
    return _ZEROS[0]


class PieceFiller:
    """The 2 MiB pieces of one field's chunk files that still hold only zeros.

    Parameters
    ----------
    chunk_rows, row_bytes, chunk_bytes : int
        The field's chunk: rows, bytes of a row, bytes of a chunk file.
    sole : bool
        This process is the store's only writer; without it nothing is ever filled.
    """

    def __init__(self, chunk_rows: int, row_bytes: int, chunk_bytes: int, sole: bool) -> None:
        self.C, self.rb, self.size = chunk_rows, row_bytes, chunk_bytes
        self.sole = sole
        # Chunk files this process made -> bytes at their start it has filled with zeros (pieces).
        self._filled: dict[int, int] = {}
        # The end of the highest physical row written or prepared by this process: no row of a
        # chunk file lies past it, so a chunk file made here holds only zeros past both marks.
        self.hi_row = 0
        #: Writes ending past this physical row may reach a piece to fill (a cheap test per write).
        self.next_row = 0 if sole else sys.maxsize

    def made(self, k: int) -> None:
        """Chunk file ``k`` was just created by this process (all zeros)."""
        if self.sole:
            self._filled[k] = 0
            self.next_row = min(self.next_row, k * self.C)

    def forget(self, k: int) -> None:
        """Chunk file ``k`` was replaced (a rewrite): nothing is known of it."""
        self._filled.pop(k, None)

    def _large(self) -> bool:
        """Filling is on and this process has written 2 MiB of this field's rows (or rows that far)."""
        return FILL_FOLIOS and self.hi_row * self.rb >= _syscalls.HUGE

    def _zeros_from(self, k: int) -> int | None:
        """Bytes of chunk file ``k`` past which it holds only zeros; None if not known."""
        filled = self._filled.get(k)
        if filled is None:
            return None
        return max(filled, min(max(self.hi_row - k * self.C, 0), self.C) * self.rb)

    def _after(self, k: int) -> None:
        """Set :attr:`next_row` from chunk file ``k``, the last one written."""
        q = self._filled.get(k)
        if q is not None and q + _syscalls.HUGE <= self.size:
            self.next_row = k * self.C + q // self.rb
        else:
            self.next_row = (k + 1) * self.C

    def around(self, k: int, a: int, b: int) -> tuple[int, int]:
        """Zero bytes to write before and after a block of rows at bytes ``[a, b)`` of chunk file
        ``k``, in the block's own write: out to the edges of the pieces that ``a`` and ``b`` fall
        in, for each such piece that lies whole in the file and holds only zeros; else 0.  The
        caller allocates the bytes after ``b`` first, and calls :meth:`not_filled` if it cannot."""
        start = self._zeros_from(k) if self._large() else None
        if start is None:
            return 0, 0
        huge = _syscalls.HUGE
        qa, qb = a - a % huge, b - b % huge  # the pieces the block starts and ends in
        lead = a - qa if a != qa and qa >= start and qa + huge <= self.size else 0
        pad = qb + huge - b if b != qb and qb >= start and qb + huge <= self.size else 0
        if pad:
            self._filled[k] = qb + huge
        self._after(k)
        return lead, pad

    def not_filled(self, k: int) -> None:
        """Zeros this object asked for in chunk file ``k`` could not be written: forget the file
        (nothing more is filled there)."""
        self._filled.pop(k, None)

    def pieces_to_fill(self, phys_lo: int, phys_hi: int) -> list[tuple[int, int]]:
        """``(chunk, byte)`` of each whole piece that rows ``[phys_lo, phys_hi)`` reach and that holds
        only zeros, to be filled (and marked filled here) before the rows are stored."""
        out: list[tuple[int, int]] = []
        if not self._large():
            self.next_row = max(self.next_row, -(-_syscalls.HUGE // self.rb))  # (this test again from there)
            return out
        huge, C = _syscalls.HUGE, self.C
        k_hi = (phys_hi - 1) // C
        for k in range(phys_lo // C, k_hi + 1):
            start = self._zeros_from(k)
            b = min(phys_hi - k * C, C) * self.rb
            if start is None or b <= start:
                continue
            q = -(-start // huge) * huge
            while q < b and q + huge <= self.size:
                out.append((k, q))
                q += huge
            self._filled[k] = max(self._filled[k], q)
        self._after(k_hi)
        return out

    def piece_rows(self, k: int, q: int) -> tuple[int, int]:
        """Physical rows whose pages lie wholly inside the piece at byte ``q`` of chunk file ``k``."""
        return k * self.C + -(-q // self.rb), k * self.C + min(self.C, (q + _syscalls.HUGE) // self.rb)
