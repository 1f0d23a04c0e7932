"""Fields over arrays trajstore did not write: a store opened in place (``open_diffusion_policy``).

:class:`ForeignField`
    One zarr array of another layout (zarr format 2 or 3, any codec zarr-python reads, any chunk
    grid), read-only, through :class:`~trajstore.storage.fields.chunked.ChunkedField`'s
    whole-chunk reads and its bounded decoded-chunk cache.  Its shape, chunking and dtype are
    checked against the limits trajstore's own stores have before a byte is read.
:class:`EpisodeIdField`
    The episode id of each row, computed from the cumulative ends of the episodes (row ``r``
    belongs to episode ``searchsorted(ends, r, side="right")``), so a table over foreign arrays
    has the id column a trajectory buffer reads, without storing one.

Both are :class:`~trajstore.storage.fields.base.Field` s whose writing methods raise
:class:`~trajstore.errors.ReadOnlyError`.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np
import zarr

from trajstore.errors import (
    DamagedStoreError,
    ForeignFileError,
    ReadOnlyError,
    TrajstoreError,
    UnsupportedSpaceError,
)
from trajstore.storage.fields.base import edit_chunk, gather_windows_by_rows
from trajstore.storage.fields.chunked import ChunkedField
from trajstore.storage.fields.spec import FieldSpec
from trajstore.storage.location import Location
from trajstore.storage.schema import ALLOWED_DTYPES, MAX_ARRAY_BYTES, MAX_CHUNK_BYTES, MAX_CHUNKS, MAX_ROW_ELEMENTS

__all__ = ["ForeignField", "EpisodeIdField", "foreign_spec", "WHOLE_BYTES"]

#: A foreign array of at most this many decoded bytes is held decoded whole once first read.
WHOLE_BYTES = 16 << 20


def _refuse(loc: Location, what: str) -> NoReturn:
    raise ReadOnlyError(f"{loc.url}: opened in place, read-only ({what}); copy it into a store of its own to write")


def foreign_spec(z: Any, path: str, where: str) -> FieldSpec:
    """The :class:`FieldSpec` of the foreign zarr array ``z`` (stored under ``path``), checked.

    Rows are axis 0; ``chunk_rows`` is the array's chunk (or shard) length along it, the unit the
    decoded-chunk cache holds.  The dtype becomes native-endian (zarr format 2 arrays may be
    big-endian; values are converted as chunks are read).

    Raises
    ------
    UnsupportedSpaceError
        A dtype trajstore does not store (strings, structured, complex, ...).
    ForeignFileError
        (a DamagedStoreError) No row axis, or sizes beyond the limits of trajstore's own stores
        (elements per row, bytes per chunk, chunks, bytes per array): a store is input, and
        nothing is allocated from a size that has not been checked.
    """
    shape = tuple(int(s) for s in z.shape)
    if len(shape) < 1:
        raise ForeignFileError(f"{where}: a 0-d array; expected rows along axis 0")
    dt = np.dtype(z.dtype)
    native = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt
    if native not in ALLOWED_DTYPES:
        raise UnsupportedSpaceError(f"{where} has dtype {dt}; expected bool, integers or floats")
    row_shape = shape[1:]
    elements = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    if elements > MAX_ROW_ELEMENTS:
        raise ForeignFileError(f"{where}: rows of shape {list(row_shape)} hold more than {MAX_ROW_ELEMENTS} elements; "
                               "not plausible")
    grid = getattr(z, "shards", None) or z.chunks
    chunk_rows = int(grid[0])
    row_bytes = max(elements * native.itemsize, 1)
    if chunk_rows < 1 or chunk_rows * row_bytes > MAX_CHUNK_BYTES:
        raise ForeignFileError(f"{where}: chunks of {chunk_rows} rows of {row_bytes} bytes; expected at most "
                               f"{MAX_CHUNK_BYTES} bytes per chunk")
    if -(-shape[0] // chunk_rows) > MAX_CHUNKS or shape[0] * row_bytes > MAX_ARRAY_BYTES:
        raise ForeignFileError(f"{where}: {shape[0]} rows in chunks of {chunk_rows}: more than {MAX_CHUNKS} chunks or "
                               f"{MAX_ARRAY_BYTES} bytes; not plausible")
    return FieldSpec(path, row_shape, native, chunk_rows, "foreign")


class ForeignField(ChunkedField):
    """A foreign zarr array (format 2 or 3, folder or zip) read whole chunks at a time through
    zarr-python into :class:`ChunkedField`'s decoded-chunk cache; read-only.

    Parameters
    ----------
    loc : Location
        The store (opened read-only); only named in messages: reads go through ``zarray``.
    spec : FieldSpec
        From :func:`foreign_spec`.
    zarray : zarr.Array
        The array, opened read-only from ``loc``'s zarr store.
    """

    def __init__(self, loc: Location, spec: FieldSpec, zarray: zarr.Array[Any]) -> None:
        super().__init__(loc, spec, zarray, writable=False)
        # A small array (actions, low-dimensional states) is decoded whole on first use and kept:
        # a batch is then one fancy index instead of a lookup per chunk it touches.
        self._whole: np.ndarray | None = None
        self._keep_whole = self.allocated * self.spec.row_bytes <= WHOLE_BYTES

    def gather(self, phys: np.ndarray) -> np.ndarray:
        if self._keep_whole and self._whole is None:
            try:
                self._whole = self._gather_whole(np.arange(self.allocated), np.arange(self.allocated) // self.C)
                self._cache.clear()  # its chunks are all in the whole copy now
            except DamagedStoreError:
                self._keep_whole = False  # a damaged chunk: the other chunks stay readable one by one
        if self._whole is not None:
            return self._whole[phys]
        return super().gather(phys)

    def _gather_whole(self, phys: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Rows ``phys`` (chunks ``ks``) from whole decoded chunks: rows sorted by chunk once, then
        one slice per chunk (not a mask over the batch per chunk)."""
        order = np.argsort(ks, kind="stable")
        sk = ks[order]
        uniq, first = np.unique(sk, return_index=True)
        chunks = self._chunks(uniq.tolist())
        out = np.empty((len(phys), *self.spec.row_shape), dtype=self.spec.dtype)
        bounds = np.append(first, len(sk)).tolist()
        for j, k in enumerate(uniq.tolist()):
            sel = order[bounds[j] : bounds[j + 1]]
            out[sel] = chunks[k][phys[sel] - k * self.C]
        return out

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        return self.gather(np.arange(lo, hi))

    def close(self) -> None:
        self._whole = None
        super().close()

    def _row_reads_possible(self) -> bool:
        # Decoding single rows from blosc frames assumes trajstore's chunk keys and chunks of whole
        # rows; a foreign array may have neither, so chunks are decoded whole, by zarr.
        return False

    def _fetch(self, ks: list[int]) -> dict[int, np.ndarray]:
        try:
            return super()._fetch(ks)
        except (TrajstoreError, MemoryError):
            raise
        except Exception as e:  # a missing or garbage chunk, whatever zarr or a codec raises for it
            raise DamagedStoreError(f"{self.loc.url}: {self.spec.array_path}: chunk(s) {ks[:8]} cannot be read "
                                    f"({type(e).__name__}: {e})") from None

    def grow(self, allocated: int) -> None:
        _refuse(self.loc, f"grow {self.spec.array_path}")

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        _refuse(self.loc, f"write {self.spec.array_path}")

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        _refuse(self.loc, f"rewrite {self.spec.array_path}")

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Nothing is ever written."""


class EpisodeIdField:
    """Episode ids of rows computed from the cumulative episode ends (a
    :class:`~trajstore.storage.fields.base.Field`; nothing stored).

    Parameters
    ----------
    loc : Location
        The store the ends come from (named in messages).
    path : str
        What the field is called (``"meta/episode_ends"``).
    ends : (E,) int64
        Strictly increasing, positive ends of the episodes: episode ``e`` is rows
        ``ends[e-1]:ends[e]`` (``ends[-1]`` is the number of rows).
    chunk_rows : int
        Rows per (virtual) chunk, for :meth:`read_chunk`.
    """

    keeps_partial_chunk = False
    writable = False
    open_from: int | None = None

    def end_run(self, row: int) -> None:
        """Read-only: nothing is written."""

    def __init__(self, loc: Location, path: str, ends: np.ndarray, chunk_rows: int) -> None:
        self.loc = loc
        self.ends = np.asarray(ends, np.int64)
        self.spec = FieldSpec(path, (), np.dtype(np.int64), chunk_rows, "foreign")
        self.C = chunk_rows
        self.allocated = int(self.ends[-1]) if len(self.ends) else 0

    def gather(self, phys: np.ndarray) -> np.ndarray:
        """Ids of rows ``phys`` (any shape), int64."""
        return np.searchsorted(self.ends, np.asarray(phys, np.int64), side="right").astype(np.int64)

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """Ids of ``length`` consecutive rows from each of ``phys`` (B,): (B, length) int64."""
        return gather_windows_by_rows(self, phys, length)

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        """Ids of rows ``[lo, hi)``: (hi - lo,) int64 (always computed afresh)."""
        # One binary search per episode touched, then runs of equal ids (no search per row).
        first, last = self.gather(np.array([lo, max(hi - 1, lo)]))
        bounds = np.clip(self.ends[first:last], lo, hi)
        lengths = np.diff(np.concatenate([[lo], bounds, [hi]]))
        return np.repeat(np.arange(first, last + 1, dtype=np.int64), lengths)

    def read_chunk(self, k: int) -> np.ndarray:
        """Ids of the rows of (virtual) chunk ``k``: (C,) int64."""
        return self.read_range(k * self.C, (k + 1) * self.C)

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Nothing to map."""

    def grow(self, allocated: int) -> None:
        """Refused: raises ReadOnlyError."""
        _refuse(self.loc, "add rows")

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        """Refused: raises ReadOnlyError."""
        _refuse(self.loc, "write episode ids")

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        """Chunk ``k`` with rows ``offs`` replaced (:meth:`Field.edited_chunk`; staging it is refused)."""
        return edit_chunk(self, k, offs, values, src)

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Refused: raises ReadOnlyError."""
        _refuse(self.loc, "rewrite episode ids")

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Nothing is cached."""

    def reload(self) -> None:
        """Nothing is cached."""

    def drop_cache(self) -> None:
        """Nothing is cached."""

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Nothing is ever written."""

    def close(self) -> None:
        """Nothing to release."""
