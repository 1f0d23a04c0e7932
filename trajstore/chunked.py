"""``ChunkedField``: a field read and written through zarr-python a whole chunk at a time.

Compressed layouts, and every non-local store.  The writer keeps the chunks it is filling in RAM
and writes them out complete on ``flush``; decoded chunks are cached (bounded) and dropped
whenever another process may have changed them.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import zarr

from .confined import full_disk as _full_disk
from .errors import DamagedStoreError, TrajstoreError
from .fieldspec import (
    CACHE_BYTES,
    FieldSpec,
    chunk_key,
    gather_windows_by_rows,
    open_zarr_array,
)
from .storage import Location, fsync_dir

__all__ = ["ChunkedField"]


class ChunkedField:
    """A field read and written through zarr-python, whole chunks at a time."""

    def __init__(self, loc: Location, spec: FieldSpec, zarray: zarr.Array, writable: bool):
        self.loc, self.spec, self.writable = loc, spec, writable
        self.C = spec.chunk_rows
        self.z = zarray
        self.allocated = int(zarray.shape[0])
        self._ndim = len(spec.row_shape) + 1
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._dirty: set[int] = set()
        self._written: set[str] = set()  # keys written since the last fsync (local stores)
        self._override: dict[int, str] = {}  # chunk -> staging prefix it is read from (pending rewrite)

    def grow(self, allocated: int) -> None:
        if self.z.shape[0] < allocated:  # another process may have resized it already
            try:
                self.z = open_zarr_array(self.loc, self.spec, allocated, self.writable)
            except OSError as e:
                raise _full_disk(e, self._where("zarr.json"), f"resize {self.spec.array_path} to {allocated} rows")
        self.allocated = allocated

    def _where(self, key: str) -> str:
        """A path (local) or URL naming ``key`` of this field, for error messages."""
        full = f"{self.spec.array_path}/{key}"
        return str(self.loc.path(full)) if self.loc.is_local else f"{self.loc.url}/{full}"

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Nothing to map: chunks are fetched on demand."""

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
            shape0 = self.z.shape[0]
            rows = np.concatenate([np.arange(k * self.C, min((k + 1) * self.C, shape0)) for k in plain])
            with self._decoding(plain):
                data = self.z.oindex[rows] if len(plain) > 1 else self.z[rows[0] : rows[-1] + 1]
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
            raise DamagedStoreError(f"{self.loc.url}: {self.spec.array_path}: chunk(s) {ks[:8]} do not decode "
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
                z = zarr.open_array(self.loc.zstore, path=f"{prefix}/{self.spec.array_path}", mode="r")
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

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        n, pos = len(data), 0
        while pos < n:
            r = phys_lo + pos
            k, off = divmod(r, self.C)
            take = min(self.C - off, n - pos)
            if k not in self._cache:
                # A chunk overwritten whole needs no read; otherwise keep its other rows.
                self._cache[k] = self._empty_chunk() if take == self.C else self._fetch([k])[k]
            self._cache[k][off : off + take] = data[pos : pos + take]
            self._dirty.add(k)
            pos += take

    def gather(self, phys: np.ndarray) -> np.ndarray:
        ks = phys // self.C
        uniq = np.unique(ks).tolist()
        chunks = self._chunks(uniq)
        out = np.empty((len(phys), *self.spec.row_shape), dtype=self.spec.dtype)
        if len(uniq) == 1:
            out[:] = chunks[uniq[0]][phys - uniq[0] * self.C]
            return out
        for k in uniq:
            sel = ks == k
            out[sel] = chunks[k][phys[sel] - k * self.C]
        return out

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        return gather_windows_by_rows(self, phys, length)

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        return self.gather(np.arange(lo, hi))

    def read_chunk(self, k: int) -> np.ndarray:
        return self._chunks([k])[k].copy()

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        key = chunk_key(self.spec.array_path, k, self._ndim)
        try:
            staged = self._staging_array(prefix)
            hi = min((k + 1) * self.C, staged.shape[0])
            staged[k * self.C : hi] = data[: hi - k * self.C]
        except OSError as e:
            raise _full_disk(e, f"{self.loc.url}/{prefix}/{key}", f"stage chunk {k} of {self.spec.array_path}")
        return key

    def _staging_array(self, prefix: str) -> zarr.Array:
        """A zarr array with this field's metadata under ``prefix`` (so staged chunks decode alike)."""
        meta_key = f"{prefix}/{self.spec.array_path}/zarr.json"
        if not self.loc.exists(meta_key):
            self.loc.put(meta_key, self.loc.get(f"{self.spec.array_path}/zarr.json") or b"")
        staged = zarr.open_array(self.loc.zstore, path=f"{prefix}/{self.spec.array_path}", mode="r+" if self.writable else "r")
        # Roll-forward moves every staged key into place, so even an all-zero chunk must be written.
        return staged.with_config({"write_empty_chunks": True})

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Forget cached copies of ``ks``; with ``prefix``, read them from the staging area."""
        for k in ks:
            if k not in self._dirty or prefix:
                # A dirty chunk is newer than any file: the writer wrote rows into it after a
                # roll forward failed part-way (it was read from staging); it is written at the flush.
                self._cache.pop(k, None)
                self._dirty.discard(k)
            if prefix:
                self._override[k] = prefix
            else:
                self._override.pop(k, None)

    def drop_cache(self) -> None:
        """Forget clean cached chunks (another process may have rewritten them)."""
        for k in list(self._cache):
            if k not in self._dirty:
                del self._cache[k]

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Write every dirty chunk out whole (zarr never has to read-modify-write), except chunk
        ``hold`` (the one a ring eviction record leaves out: it is still being filled)."""
        shape0 = self.z.shape[0]
        for k in sorted(self._dirty):
            if k == hold:
                continue  # the chunk a ring is filling: written once it is complete
            hi = min((k + 1) * self.C, shape0)
            try:
                # zarr writes the chunk to a temp file and renames it (removing the temp on error):
                # a failed write leaves the old chunk whole, and it stays dirty for the next flush.
                self.z[k * self.C : hi] = self._cache[k][: hi - k * self.C]
            except OSError as e:
                raise _full_disk(e, self._where(chunk_key("", k, self._ndim).lstrip("/")),
                                 f"write chunk {k} of {self.spec.array_path}")
            self._dirty.discard(k)
            if self.loc.is_local:
                self._written.add(chunk_key(self.spec.array_path, k, self._ndim))
        if fsync and self._written:
            for key in self._written:
                fd = self.loc.open_inside(key, os.O_RDONLY)  # never through a link
                try:
                    os.fsync(fd)
                except OSError as e:
                    raise _full_disk(e, self.loc.path(key), f"fsync {key}")
                finally:
                    os.close(fd)
            for d in {self.loc.path(key).parent for key in self._written}:
                fsync_dir(d)
            self._written.clear()
        self._evict()

    def close(self) -> None:
        self._cache.clear()
