"""The :class:`Field` protocol: what a table asks of one stored array of rows.

Two engines implement it: :class:`~trajstore.storage.fields.mapped.MappedField` (raw chunk files
read and written through memory maps) and :class:`~trajstore.storage.fields.chunked.ChunkedField`
(compressed or remote chunks through zarr, cached decoded).  Callers never test which engine a
field is: what differs is declared (:attr:`Field.keeps_partial_chunk`) or done by the engine
(:meth:`Field.reload`).

Rows are *physical*: row ``r`` lives in chunk ``r // C`` at offset ``r % C``; a ring maps its
logical rows onto physical ones before it calls a field.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from trajstore.storage.fields.spec import FieldSpec
from trajstore.storage.location import Location

__all__ = ["Field", "edit_chunk", "gather_windows_by_rows"]


@runtime_checkable
class Field(Protocol):
    """One zarr array of rows, shape ``(allocated, *spec.row_shape)``, dtype ``spec.dtype``.

    Attributes
    ----------
    loc : Location
        The store the array lives in.
    spec : FieldSpec
        Path, row shape, dtype, chunk rows and codec of the array.
    writable : bool
        Whether this process writes the field.
    C : int
        Rows per chunk (``spec.chunk_rows``).
    allocated : int
        Rows the array is sized for (its shape[0]).
    keeps_partial_chunk : bool
        Whether the engine holds the chunk being filled in memory and writes chunks whole (so a
        ring's eviction record may leave that chunk out; see ``Table.flush``).
    """

    loc: Location
    spec: FieldSpec
    writable: bool
    C: int
    allocated: int
    keeps_partial_chunk: bool

    @property
    def open_from(self) -> int | None:
        """First physical row a flush left in memory only (a video field's episode still being
        recorded): a commit counts rows up to there.  None for engines that write every row out."""

    def end_run(self, row: int) -> None:
        """An episode ends before physical row ``row`` (a video field encodes it; others: nothing)."""

    def grow(self, allocated: int) -> None:
        """Size the array for ``allocated`` rows (the writer resizes the zarr array first)."""

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Make rows ``[phys_lo, phys_hi)`` addressable (``create``: the writer creates missing chunks)."""

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        """Copy ``data`` (n, *row_shape) into physical rows ``[phys_lo, phys_lo + n)``."""

    def gather(self, phys: np.ndarray) -> np.ndarray:
        """Rows ``phys`` (B,) int64: a new (B, *row_shape) array."""

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """``length`` consecutive physical rows from each of ``phys`` (B,): (B, length, *row_shape)."""

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        """Physical rows ``[lo, hi)``: (hi - lo, *row_shape).

        A copy; with ``copy=False`` a read-only view of the mapped file where the engine can
        give one (a scan that reads each block once and keeps nothing), valid until the field is
        remapped or closed.  Engines that decode always copy."""

    def read_chunk(self, k: int) -> np.ndarray:
        """A copy of chunk ``k``: (C, *row_shape)."""

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        """Chunk ``k`` (a copy, (C, *row_shape)) with its rows ``offs`` (n,) int64 replaced by
        ``values`` (n, *row_shape), or by the physical rows ``src`` (n,) int64 of this field, for
        :meth:`stage_chunk` (engines keeping encoded frames then encode only rows ``offs``, and
        frames moved by ``src`` not at all; see :func:`edit_chunk`)."""

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Write chunk ``k`` whole under the staging ``prefix``; returns its key (relative to the prefix)."""

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Read chunks ``ks`` afresh (their files were replaced), from the staging ``prefix`` if given."""

    def reload(self) -> None:
        """Every chunk file may have been replaced (a rewrite of committed rows): read them afresh."""

    def drop_cache(self) -> None:
        """Forget clean cached chunks (another process may have committed new ones)."""

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Write out what was written (``fsync``: durably), except chunk ``hold`` (see
        :attr:`keeps_partial_chunk`)."""

    def close(self) -> None:
        """Release maps, descriptors and caches."""


def edit_chunk(field: Field, k: int, offs: np.ndarray, values: np.ndarray | None,
               src: np.ndarray | None) -> np.ndarray:
    """:meth:`Field.edited_chunk` through the decoded rows: ``field.read_chunk(k)`` with rows
    ``offs`` set to ``values`` or to ``field.gather(src)``."""
    chunk = field.read_chunk(k)
    chunk[offs] = values if src is None else field.gather(src)
    return chunk


def gather_windows_by_rows(field: Field, phys: np.ndarray, length: int,
                           capacity: int | None = None) -> np.ndarray:
    """``field.gather_windows`` as one row gather: rows ``phys[b] + t`` (modulo ``capacity``, so
    windows may cross a ring's wrap point), shape (B, length, ...)."""
    rows = phys[:, None] + np.arange(length)
    if capacity is not None:
        rows %= capacity
    return field.gather(rows.ravel()).reshape(len(phys), length, *field.spec.row_shape)
