"""``DecodedChunks``: a field's whole chunks decoded through zarr-python and cached.

The whole-chunk side of :class:`~trajstore.storage.fields.chunked.ChunkedField` (its base class):
chunks are fetched whole, from their files or, while a rewrite is pending, from its staging area,
decoded, and kept in a bounded LRU of decoded chunks (``CACHE_BYTES``) that never drops a chunk
held newer than its file.  A chunk of committed rows whose file is missing, or whose bytes make a
codec fail, raises DamagedStoreError instead of reading as fill values.

Writes, flushes, staging and the row reads that avoid decoding whole chunks are
:class:`~trajstore.storage.fields.chunked.ChunkedField`'s; subclasses replace the decoder
(:meth:`DecodedChunks._decode_chunks`) or the gather through decoded chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Any, TypeVar, cast

import numpy as np
import zarr
from zarr.core.sync import sync

from trajstore.errors import DamagedStoreError, TrajstoreError
from trajstore.storage.fields.out import new_rows
from trajstore.storage.fields.spec import CACHE_BYTES, FieldSpec, chunk_key, sized_array
from trajstore.storage.location import Location

__all__ = ["DecodedChunks", "cached_split"]

T = TypeVar("T")


def cached_split(cache: OrderedDict[int, T], ks: list[int]) -> tuple[dict[int, T], list[int]]:
    """``({k: cache[k]} for the ``ks`` held (marked recently used), [the others])``."""
    out: dict[int, T] = {}
    missing = []
    for k in ks:
        if k in cache:
            cache.move_to_end(k)
            out[k] = cache[k]
        else:
            missing.append(k)
    return out, missing


class DecodedChunks:
    """Whole chunks of one zarr array of rows, decoded through zarr-python and cached.

    Chunk ``k`` holds physical rows ``[k * C, (k + 1) * C)``; a decoded chunk is a
    ``(C, *spec.row_shape)`` array of ``spec.dtype`` (rows past the array's end are zeros).

    Parameters
    ----------
    loc : Location
        The store the array lives in.
    spec : FieldSpec
        Path, row shape, dtype, chunk rows and codec of the array.
    zarray : zarr.Array
        The array, opened from ``loc``'s zarr store and sized to the allocated rows.
    writable : bool
        Whether this process writes the field.

    Attributes
    ----------
    C : int
        Rows per chunk (``spec.chunk_rows``).
    z : zarr.Array
        The array (resized by :meth:`grow`).
    allocated : int
        Rows the array is sized for (its shape[0]).
    """

    def __init__(self, loc: Location, spec: FieldSpec, zarray: zarr.Array[Any], writable: bool):
        self.loc, self.spec, self.writable = loc, spec, writable
        self.C = spec.chunk_rows
        self.z = zarray
        self.allocated = int(zarray.shape[0])
        self._ndim = len(spec.row_shape) + 1
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._dirty: set[int] = set()
        self._override: dict[int, str] = {}  # chunk -> staging prefix it is read from (pending rewrite)
        # Physical row runs the commit record counts, as the table last named them (a ring: at most
        # two runs; ensure_mapped): a chunk of them that is missing is damage, not fill values.
        self._committed: deque[tuple[int, int]] = deque(maxlen=2)

    def grow(self, allocated: int) -> None:
        """Size the handle to ``allocated`` rows (in memory: the allocation is the commit record's)."""
        self.z = sized_array(self.z, allocated)
        self.allocated = allocated

    def _where(self, key: str) -> str:
        """A path (local) or URL naming ``key`` of this field, for error messages."""
        full = f"{self.spec.array_path}/{key}"
        return str(self.loc.path(full)) if self.loc.is_local else f"{self.loc.url}/{full}"

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Nothing to map: chunks are fetched on demand.  A reader's call names committed rows
        (``create`` False): a chunk of them fetched later must exist (:meth:`_check_present`)."""
        # (Not for arrays trajstore did not write: their writers may leave chunks of fill values out.)
        if not create and phys_hi > phys_lo and self.spec.layout != "foreign":
            self._committed.append((phys_lo, phys_hi))

    def _check_present(self, ks: list[int]) -> None:
        """Raise DamagedStoreError if a chunk of ``ks`` holding committed rows has no key: zarr would
        read it as fill values (zeros), silently.  One existence check per chunk fetched (all of a
        batch's concurrently on a remote store); chunks are fetched once, then cached."""
        runs = list(self._committed)
        keys = {k: chunk_key(self.spec.array_path, k, self._ndim) for k in ks
                if k not in self._dirty and any(lo < (k + 1) * self.C and k * self.C < hi for lo, hi in runs)}
        if not keys:
            return
        if self.loc.is_local or len(keys) == 1:
            found = [self.loc.exists(key) for key in keys.values()]
        else:
            async def every() -> list[bool]:
                return list(await asyncio.gather(*(self.loc.zstore.exists(key) for key in keys.values())))
            found = sync(every())
        gone = [k for k, ok in zip(keys, found) if not ok]
        if gone:
            k = gone[0]
            lo, hi = next((max(a, k * self.C), min(b, (k + 1) * self.C)) for a, b in runs
                          if a < (k + 1) * self.C and k * self.C < b)
            raise DamagedStoreError(f"{self.spec.array_path}: rows {lo}..{hi - 1} (physical) are committed, but "
                                    f"their chunk {self._where(chunk_key('', k, self._ndim).lstrip('/'))} is missing "
                                    f"({len(gone)} chunk(s) of this read); run `trajstore verify`")

    def _empty_chunk(self) -> np.ndarray:
        return np.zeros((self.C, *self.spec.row_shape), dtype=self.spec.dtype)

    def _fetch(self, ks: list[int]) -> dict[int, np.ndarray]:
        """Decode whole chunks ``ks`` (one concurrent zarr read for all of them)."""
        out: dict[int, np.ndarray] = {}
        plain = []
        for k in ks:
            staged = self._read_staged(k) if k in self._override else None
            if staged is None:
                plain.append(k)
            else:
                out[k] = staged
        if plain:
            out.update(self._decode_chunks(plain))
        return out

    def _decode_chunks(self, plain: list[int]) -> dict[int, np.ndarray]:
        """Decode whole chunks ``plain`` from their files (one concurrent zarr read for all of them)."""
        out: dict[int, np.ndarray] = {}
        if plain:
            self._check_present(plain)
            shape0 = self.z.shape[0]
            rows = np.concatenate([np.arange(k * self.C, min((k + 1) * self.C, shape0)) for k in plain])
            with self._decoding(plain):
                data = cast(np.ndarray, self.z.oindex[rows] if len(plain) > 1 else self.z[rows[0] : rows[-1] + 1])
            pos = 0
            for k in plain:
                n = min((k + 1) * self.C, shape0) - k * self.C
                chunk = self._empty_chunk()
                chunk[:n] = data[pos : pos + n]
                out[k] = chunk
                pos += n
        return out

    @contextlib.contextmanager
    def _decoding(self, ks: list[int]) -> Iterator[None]:
        """Chunk files are input: whatever a garbage chunk makes a codec raise (RuntimeError from
        lz4, ValueError from a short buffer...) becomes a DamagedStoreError naming the chunks."""
        try:
            yield
        except (TrajstoreError, FileNotFoundError, KeyError, zarr.errors.ArrayNotFoundError):
            raise
        except Exception as e:
            raise DamagedStoreError(f"{self.loc.url}: {self.spec.array_path}: chunk(s) {ks[:8]} (rows {ks[0] * self.C}.."
                                    f"{(ks[0] + 1) * self.C - 1}, physical, of the first) do not decode "
                                    f"({type(e).__name__}: {e})") from None

    def _read_staged(self, k: int) -> np.ndarray | None:
        """Chunk ``k`` from its staging area, or None once it has been moved into place.

        The staged key is checked before and after the read: a rename is one-way, so if it
        still exists afterwards the read saw the staged bytes.
        """
        prefix = self._override[k]
        key = f"{prefix}/{chunk_key(self.spec.array_path, k, self._ndim)}"
        if not self.loc.exists(key):
            return None
        try:
            with self._decoding([k]):
                z = sized_array(zarr.open_array(self.loc.zstore, path=f"{prefix}/{self.spec.array_path}", mode="r"),
                                self.allocated)
                chunk = self._empty_chunk()
                hi = min((k + 1) * self.C, z.shape[0])
                chunk[: hi - k * self.C] = z[k * self.C : hi]
        except (FileNotFoundError, KeyError, zarr.errors.ArrayNotFoundError):
            return None
        return chunk if self.loc.exists(key) else None

    def _chunks(self, ks: list[int]) -> dict[int, np.ndarray]:
        missing = [k for k in ks if k not in self._cache]
        if missing:
            self._cache.update(self._fetch(missing))
        for k in ks:
            self._cache.move_to_end(k)
        got = {k: self._cache[k] for k in ks}
        self._evict()
        return got

    def _evict(self) -> None:
        nbytes = self.C * self.spec.row_bytes
        while len(self._cache) * nbytes > CACHE_BYTES and len(self._cache) > len(self._dirty) + 1:
            for k in self._cache:
                if k not in self._dirty:
                    del self._cache[k]
                    break

    def _gather_whole(self, phys: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Rows ``phys`` (chunks ``ks``) through whole decoded chunks."""
        uniq = sorted(set(ks.tolist()))  # (a first np.unique in a process imports numpy.ma: 40-60 ms)
        chunks = self._chunks(uniq)
        out = new_rows((len(phys), *self.spec.row_shape), self.spec.dtype)
        if len(uniq) == 1:
            out[:] = chunks[uniq[0]][phys - uniq[0] * self.C]
            return out
        for k in uniq:
            sel = ks == k
            out[sel] = chunks[k][phys[sel] - k * self.C]
        return out
