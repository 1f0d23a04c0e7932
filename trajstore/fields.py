"""Per-field row storage: one zarr array per leaf, read and written by physical row.

Two layouts, both ordinary zarr v3 arrays that any zarr reader opens:

``MappedField`` ("raw" layout on a local folder)
    Uncompressed chunks (codec ``bytes``, little-endian).  Each chunk file is created at
    full size and memory-mapped into one contiguous virtual array (:mod:`._vmap`); the
    writer copies rows straight into the page cache and readers gather with one numpy
    fancy index.  zarr-python is used only for metadata.

``ChunkedField`` (compressed layouts, and every non-local store)
    Reads and writes go through zarr-python a whole chunk at a time.  The writer keeps
    the chunks it is filling in RAM and writes them out complete on ``flush``; decoded
    chunks are cached (bounded) and dropped whenever another process may have changed them.

Both expose the same small interface used by :class:`trajstore.table.Table`.

A full disk (``ENOSPC``/``EDQUOT``) surfaces as :class:`trajstore.errors.StoreFullError` from
``write``/``flush``/``stage_chunk``/``grow``, raised before anything beyond the rows being
written changed: raw chunk files are allocated whole (``posix_fallocate``) before they are
mapped, so a store into a mapping never meets a full disk (which would be ``SIGBUS``).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import zarr

from . import _vmap
from .confined import full_disk as _full_disk
from .errors import DamagedStoreError, TrajstoreError
from .storage import Location, fsync_dir

__all__ = ["FieldSpec", "MappedField", "ChunkedField", "open_field", "make_field_spec", "chunk_key", "parse_compressor"]

#: Raw chunks aim at this many bytes: big enough that a field of 10 M rows is a few thousand
#: files, small enough that the writer's partial tail chunk is cheap to create.
RAW_CHUNK_BYTES = 1 << 20
#: Compressed chunks are decoded whole on a random read, so they are kept smaller.
COMPRESSED_CHUNK_BYTES = 1 << 20
#: Writes of at least this many bytes use pwrite instead of stores into the mapping.
PWRITE_BYTES = 64 << 10
#: Decoded chunks a ChunkedField keeps in RAM (clean ones; dirty ones are never dropped).
CACHE_BYTES = 256 << 20


def chunk_key(array_path: str, k: int, ndim: int) -> str:
    """zarr v3 default chunk key of chunk ``k`` along axis 0 (other axes are one chunk)."""
    return f"{array_path}/c/{k}" + "/0" * (ndim - 1)


def parse_compressor(compressor: Any, dtype: np.dtype) -> tuple[Any, str]:
    """Map the user's ``compressor`` option to zarr ``compressors=`` and a short label.

    Accepts ``None``/``"none"`` (raw), ``"lz4"``, ``"zstd"``, a zarr bytes-to-bytes codec,
    or a numcodecs codec (wrapped with ``zarr.codecs.numcodecs``).
    """
    if compressor is None or compressor == "none":
        return None, "none"
    if isinstance(compressor, str):
        names = {"lz4": ("lz4", 5), "zstd": ("zstd", 3)}
        if compressor not in names:
            raise ValueError(f"compressor must be None, 'lz4', 'zstd' or a codec object; got {compressor!r}")
        cname, level = names[compressor]
        codec = zarr.codecs.BloscCodec(cname=cname, clevel=level, shuffle="shuffle", typesize=dtype.itemsize)
        return codec, compressor
    if isinstance(compressor, zarr.abc.codec.BytesBytesCodec):
        return compressor, type(compressor).__name__
    if hasattr(compressor, "get_config") and hasattr(compressor, "codec_id"):
        import zarr.codecs.numcodecs as zn

        cfg = {k: v for k, v in compressor.get_config().items() if k != "id"}
        wrapper = getattr(zn, type(compressor).__name__, None)
        if wrapper is None:
            raise ValueError(f"numcodecs codec {compressor!r} has no zarr v3 wrapper in zarr.codecs.numcodecs")
        return wrapper(**cfg), compressor.codec_id
    raise ValueError(f"compressor must be None, 'lz4', 'zstd' or a codec object; got {compressor!r}")


class FieldSpec:
    """Static description of one stored field (written once into the store's attributes)."""

    def __init__(self, array_path: str, row_shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int, layout: str,
                 compressor: Any = None):
        self.array_path = array_path
        self.compressor = compressor  # only used at create; afterwards zarr's metadata holds the codec
        self.row_shape = tuple(int(s) for s in row_shape)
        self.dtype = np.dtype(dtype)
        self.chunk_rows = int(chunk_rows)
        self.layout = layout  # "raw" or "compressed"

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"path": self.array_path, "chunk_rows": self.chunk_rows, "layout": self.layout}


def _raw_row_align(row_bytes: int) -> int:
    """Smallest row count whose bytes fill whole pages, so chunks tile an address range."""
    return _vmap.PAGE // math.gcd(row_bytes, _vmap.PAGE)


def make_field_spec(
    array_path: str,
    row_shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    capacity: int | None,
    compressor: Any,
    chunk_rows: int | None,
) -> FieldSpec:
    """Choose the chunk rows of a new field (see RAW_CHUNK_BYTES / COMPRESSED_CHUNK_BYTES)."""
    row_bytes = max(int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 1)
    if compressor is not None and compressor != "none":
        rows = chunk_rows or 1 << max(int(math.log2(max(COMPRESSED_CHUNK_BYTES // row_bytes, 1))), 0)
        if capacity is not None:
            rows = min(rows, capacity)
        return FieldSpec(array_path, row_shape, dtype, max(rows, 1), "compressed", compressor)
    align = _raw_row_align(row_bytes)
    rows = chunk_rows or max(RAW_CHUNK_BYTES // row_bytes, 1)
    if capacity is not None:
        rows = min(rows, capacity)
    rows = -(-rows // align) * align  # round up to whole pages
    return FieldSpec(array_path, row_shape, dtype, rows, "raw")


def gather_windows_by_rows(field: "MappedField | ChunkedField", phys: np.ndarray, length: int,
                           capacity: int | None = None) -> np.ndarray:
    """``field.gather_windows`` as one row gather: rows ``phys[b] + t`` (modulo ``capacity``, so
    windows may cross a ring's wrap point), shape (B, length, ...)."""
    rows = phys[:, None] + np.arange(length)
    if capacity is not None:
        rows %= capacity
    return field.gather(rows.ravel()).reshape(len(phys), length, *field.spec.row_shape)


class MappedField:
    """A raw field on a local folder, memory-mapped chunk by chunk into one virtual array."""

    def __init__(self, loc: Location, spec: FieldSpec, allocated: int, writable: bool):
        self.loc, self.spec, self.writable = loc, spec, writable
        self.C = spec.chunk_rows
        self._ndim = len(spec.row_shape) + 1
        self._synced: set[int] = set()  # chunks written since the last fsync
        self._last_k = -1
        self._fds: dict[int, int] = {}  # writer: open chunk files for pwrite of large blocks
        self._va = self._reserve(allocated)
        self.allocated = allocated

    def _reserve(self, allocated: int) -> _vmap.VirtualArray:
        va = _vmap.VirtualArray(-(-allocated // self.C), self.C, self.spec.row_shape, self.spec.dtype, self.writable)
        if self.writable:
            va.array.flags.writeable = True
        return va

    def _path(self, k: int, prefix: str = "") -> str:
        key = chunk_key(self.spec.array_path, k, self._ndim)
        return str(self.loc.path(f"{prefix}/{key}" if prefix else key))

    @property
    def array(self) -> np.ndarray:
        return self._va.array

    def grow(self, allocated: int) -> None:
        """Re-reserve a larger range and map the same chunk files into it (the writer first
        resizes the zarr array, so plain zarr readers see every committed row)."""
        if self.writable:
            try:
                _open_zarr(self.loc, self.spec, allocated, writable=True)
            except OSError as e:
                raise _full_disk(e, self.loc.path(f"{self.spec.array_path}/zarr.json"),
                                 f"resize {self.spec.array_path} to {allocated} rows")
        old = self._va
        self._va = self._reserve(allocated)
        for k in np.flatnonzero(old.mapped):
            self._va.map_chunk(int(k), self._path(int(k)))
        old.close()
        self.allocated = allocated

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Map every chunk file touching rows ``[phys_lo, phys_hi)``; the writer creates missing ones."""
        if phys_hi <= phys_lo:
            return
        k_lo, k_hi = phys_lo // self.C, (phys_hi - 1) // self.C + 1
        todo = np.flatnonzero(~self._va.mapped[k_lo:k_hi])
        for k in (todo + k_lo).tolist():
            path = self._path(k)
            if not os.path.exists(path):
                if not create:
                    continue  # never written: reads as zeros, as zarr reads a missing chunk
                self._create_chunk_file(path)
            self._map(k, path)

    def _create_chunk_file(self, path: str) -> None:
        """Create chunk file ``path`` full size, zero-filled and with its blocks allocated.

        Allocated, not sparse: the writer stores rows through a shared mapping, and a store into
        a hole that a full filesystem cannot fill is ``SIGBUS``.  Reserving here turns a full disk
        into a :class:`StoreFullError` before any row is written.  Built under a temp name and
        renamed, so a chunk file is never seen half-made; on failure the temp file is removed.
        """
        tmp = None
        try:
            tmp = self.loc.new_tmp_path()
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                _vmap.reserve(fd, self._va.chunk_bytes, fresh=True)
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise _full_disk(e, path, f"create chunk file ({self._va.chunk_bytes} bytes)")

    def _map(self, k: int, path: str) -> None:
        try:
            self._va.map_chunk(k, path)
        except EOFError as e:
            raise DamagedStoreError(str(e)) from None
        except OSError as e:
            raise _full_disk(e, path, "reserve space for a chunk file created sparse")

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Map chunk files again (after they were replaced by rename), optionally from a staging prefix.

        A staged file that is gone has already been moved into place: the main file is it.  A
        mapping keeps its file's content even if the file is renamed afterwards.
        """
        self._close_fds(ks)  # they may name replaced files
        for k in ks:
            for path in ([self._path(k, prefix)] if prefix else []) + [self._path(k)]:
                try:
                    self._map(k, path)
                    break
                except FileNotFoundError:
                    continue
            else:
                if self._va.mapped[k]:
                    self._va.unmap_chunk(k)

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        """Copy ``data`` (n, *row_shape) into physical rows ``[phys_lo, phys_lo + n)``."""
        n = len(data)
        k_lo, k_hi = phys_lo // self.C, (phys_lo + n - 1) // self.C
        mapped = self._va.mapped
        if not (mapped[k_lo] and mapped[k_hi]) or (k_hi - k_lo > 1 and not mapped[k_lo : k_hi + 1].all()):
            self.ensure_mapped(phys_lo, phys_lo + n, create=True)
        if data.nbytes >= PWRITE_BYTES:
            self._pwrite(phys_lo, data)
        else:
            self._va.array[phys_lo : phys_lo + n] = data
        if k_lo != self._last_k or k_hi != k_lo:  # per-step appends stay in one chunk: skip the set update
            self._synced.update(range(k_lo, k_hi + 1))
            self._last_k = k_hi

    def _pwrite(self, phys_lo: int, data: np.ndarray) -> None:
        """Large blocks go through ``pwrite`` into the page cache: first writes to a fresh page of
        a mapping fault one page at a time, which costs more than the copy itself."""
        buf = np.ascontiguousarray(data, dtype=self._va.dtype).reshape(-1).view(np.uint8)
        row_bytes = self._va.chunk_bytes // self.C
        pos, n = 0, len(data)
        while pos < n:
            k, off = divmod(phys_lo + pos, self.C)
            take = min(self.C - off, n - pos)
            fd = self._fds.get(k)
            if fd is None:
                if len(self._fds) >= 8:  # appends touch one or two chunks at a time
                    os.close(self._fds.pop(next(iter(self._fds))))
                fd = self._fds[k] = os.open(self._path(k), os.O_WRONLY | os.O_NOFOLLOW)  # never through a link
            try:
                os.pwrite(fd, buf[pos * row_bytes : (pos + take) * row_bytes], off * row_bytes)
            except OSError as e:  # the chunk's space is reserved, so only a file made elsewhere gets here
                raise _full_disk(e, self._path(k), f"write rows into chunk {k}")
            pos += take

    def _close_fds(self, ks: list[int] | None = None) -> None:
        for k in list(self._fds) if ks is None else ks:
            fd = self._fds.pop(k, None)
            if fd is not None:
                os.close(fd)

    def gather(self, phys: np.ndarray) -> np.ndarray:
        return self._va.array[phys]

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """Copies of ``length`` consecutive physical rows from each of ``phys`` (B,): (B, length, ...).

        Each window is one element of a ``void`` view whose elements overlap (stride one row), so
        numpy copies it with one ``memcpy``: far fewer page-table walks and cache misses than
        gathering B x length rows.  A first pass loads the first and last byte of every window:
        those loads are independent, so the page walks and cache misses of all windows overlap
        instead of stalling one window's copy after another (on a store far larger than the
        caches this halves the memory stalls; docs/benchmarks.md).
        """
        a = self._va.array
        row_bytes = a.strides[0]
        window = length * row_bytes
        raw = a.reshape(-1).view(np.uint8)
        view = np.ndarray((len(a) - length + 1,), np.dtype((np.void, window)), buffer=raw, strides=(row_bytes,))
        at = phys * row_bytes
        raw.take(np.concatenate([at, at + (window - 1)]))
        return view[phys].view(a.dtype).reshape(len(phys), length, *a.shape[1:])

    def read_range(self, lo: int, hi: int) -> np.ndarray:
        return self._va.array[lo:hi].copy()

    def read_chunk(self, k: int) -> np.ndarray:
        return self._va.array[k * self.C : (k + 1) * self.C].copy()

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Write a full chunk under the staging ``prefix``; returns its key (relative to the prefix)."""
        key = chunk_key(self.spec.array_path, k, self._ndim)
        try:
            self.loc.put(f"{prefix}/{key}", np.ascontiguousarray(data, dtype=self._va.dtype).tobytes())
        except OSError as e:
            raise _full_disk(e, self.loc.path(f"{prefix}/{key}"), f"stage chunk {k} of {self.spec.array_path}")
        return key

    def drop_cache(self) -> None:
        """Nothing to drop: mapped pages are the files themselves."""

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Rows are in the page cache as soon as they are written; ``fsync`` makes them durable
        (``hold`` is for compressed fields: a mapped chunk needs no writing out)."""
        if fsync:
            for k in sorted(self._synced):
                if self._va.mapped[k]:
                    try:
                        self._va.sync(k)
                    except OSError as e:
                        raise _full_disk(e, self._path(k), f"msync chunk {k}")
            dirs = {os.path.dirname(self._path(k)) for k in self._synced}
            for d in dirs:
                fsync_dir(Path(d))
            # Only an fsync makes them durable: chunks written before a plain flush stay listed.
            self._synced.clear()
            self._last_k = -1

    def close(self) -> None:
        self._close_fds()
        self._va.close()


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
                self.z = _open_zarr(self.loc, self.spec, allocated, self.writable)
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


def _open_zarr(loc: Location, spec: FieldSpec, allocated: int, writable: bool) -> zarr.Array:
    """The field's zarr array, re-read from the store; a writer resizes it to ``allocated`` rows
    if another handle has not already (zarr.json only; no chunk is touched)."""
    z = zarr.open_array(loc.zstore, path=spec.array_path, mode="r+" if writable else "r")
    if writable and z.shape[0] < allocated:
        z.resize((allocated, *spec.row_shape))
    return z.with_config({"write_empty_chunks": True})


def open_field(loc: Location, spec: FieldSpec, group: zarr.Group, allocated: int, writable: bool) -> MappedField | ChunkedField:
    """The right reader/writer for ``spec`` on ``loc``."""
    if spec.layout == "raw" and loc.is_local and _vmap.SUPPORTED and (spec.chunk_rows * spec.row_bytes) % _vmap.PAGE == 0 and spec.row_bytes:
        return MappedField(loc, spec, allocated, writable)
    zarray = group[spec.array_path].with_config({"write_empty_chunks": True})  # type: ignore[union-attr]
    return ChunkedField(loc, spec, zarray, writable)  # type: ignore[arg-type]
