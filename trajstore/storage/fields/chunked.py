"""``ChunkedField``: a field read and written through zarr-python a whole chunk at a time.

Compressed layouts, and every non-local store.  The writer keeps the chunks it is filling in RAM
and writes them out complete on ``flush``; decoded chunks are cached (bounded) and dropped
whenever another process may have changed them (fetching, decoding and caching whole chunks:
its base class, :class:`~trajstore.storage.fields.decoded.DecodedChunks`).

Random rows of blosc-compressed chunks are not decoded a chunk at a time: a blosc frame is a
header, a table of block offsets and independently compressed blocks (a shard with its index in
front; :func:`trajstore.storage.fields.spec.row_block_codec` makes one block per row), so a row is read by
decoding only the blocks that hold it (``blosc_getitem``; small rows: blocks of about 2 KiB,
:mod:`trajstore.storage.fields._rowblocks`, which also keeps the frames and runs a batch's
decodes).  The encoded chunk is memory-mapped (local folders) or fetched, all chunks of a batch
concurrently (other stores), and its header and offset table are checked before c-blosc sees
them: a hostile frame raises DamagedStoreError.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import numpy as np
import zarr

from trajstore.errors import DamagedStoreError
from trajstore.storage.confined import full_disk as _full_disk
from trajstore.storage.fields._blosc import GETITEM as _GETITEM
from trajstore.storage.fields._blosc import Frame as _Frame
from trajstore.storage.fields._rowblocks import FrameCache as _FrameCache
from trajstore.storage.fields._rowblocks import small_blocks as _small_blocks
from trajstore.storage.fields.base import edit_chunk, gather_windows_by_rows
from trajstore.storage.fields.decoded import DecodedChunks, cached_split
from trajstore.storage.fields.out import new_rows, temporary_rows
from trajstore.storage.fields.ranges import dense_runs, get_ranges, raw_dtype
from trajstore.storage.fields.spec import (
    CACHE_BYTES,
    FieldSpec,
    chunk_key,
    sized_array,
)
from trajstore.storage.location import Location, fsync_dir

__all__ = ["ChunkedField", "cached_split", "map_file"]

#: A batch decodes a chunk whole (not row by row) once it wants more than this share of its rows.
WHOLE_CHUNK_SHARE = 0.25
#: Fields of at most this many allocated bytes read random rows from whole decoded chunks (they fit
#: the decoded cache, whose hits beat decoding a block per row); bigger ones decode rows alone.
ROW_READS_ABOVE_BYTES = CACHE_BYTES // 2
#: ... unless their blocks are small (trajstore.storage.fields._rowblocks.small_blocks: lz4 vector rows
#: of new stores): a block decode then costs about what a cached chunk's row does, at every size.
SMALL_BLOCK_ROW_READS_ABOVE_BYTES = 8 << 20
#: Encoded chunks kept in RAM (other stores), at most this many / bytes per field.  Local fields
#: keep theirs memory-mapped within the process-wide bound on mapped frames
#: (trajstore.storage.fields._rowblocks.MAPS: a quarter of vm.max_map_count, at most 16 GiB of
#: address space): a mapping costs a map and address space, not RAM.
MAX_ENCODED = 4096
ENCODED_BYTES = CACHE_BYTES


def map_file(loc: Location, key: str, nbytes: int, populate: bool = False) -> tuple[np.ndarray | None, object]:
    """The file ``key`` of local store ``loc`` memory-mapped read-only, as a uint8 array, and the
    map that owns it; ``(None, None)`` when it is missing, empty, or larger than about ``nbytes``
    (left to the caller's whole-chunk path or its damage report).  Files are replaced by rename,
    never truncated, so the map stays valid; it shows the old bytes until mapped again.  With
    ``populate`` (Linux) its page tables are filled at once, not a fault per 64 KiB later."""
    try:
        fd = loc.open_inside(key, os.O_RDONLY)
    except FileNotFoundError:
        return None, None
    try:
        size = os.fstat(fd).st_size
        if size < 16 or size > nbytes + (nbytes >> 4) + 4096:
            return None, None
        if populate and hasattr(mmap, "MAP_POPULATE"):  # (Linux)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        else:
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)  # access=, not prot=: portable to Windows
    finally:
        os.close(fd)
    return np.frombuffer(mm, np.uint8), mm


class ChunkedField(DecodedChunks):
    """A field read and written through zarr-python, whole chunks at a time (a
    :class:`~trajstore.storage.fields.base.Field`; whole chunks decoded and cached by
    :class:`~trajstore.storage.fields.decoded.DecodedChunks`)."""

    keeps_partial_chunk = True  # the chunk being filled stays in memory until flush writes it whole
    open_from: int | None = None  # every row written goes out at flush

    def end_run(self, row: int) -> None:
        """Episodes are not this engine's concern (video fields encode them)."""

    def __init__(self, loc: Location, spec: FieldSpec, zarray: zarr.Array[Any], writable: bool):
        super().__init__(loc, spec, zarray, writable)
        self._written: set[str] = set()  # keys written since the last fsync (local stores)
        self._rb = spec.row_bytes
        # chunk -> encoded frame (None: decode whole); mapped (local: the process-wide MAPS bound)
        # or fetched (MAX_ENCODED / ENCODED_BYTES)
        self._frames = _FrameCache(f"{loc.url}: {spec.array_path}", self.C, self._rb, self._read_frames,
                                   not loc.is_local, MAX_ENCODED, ENCODED_BYTES)
        self._partial = self._row_reads_possible()
        # A one-pass reader of raw chunks in an icechunk repository (a pull: the location's
        # ``ranged_reads``) fetches runs of rows as byte ranges (storage/fields/ranges.py), so a
        # pull of some episodes transfers about their bytes only; others cache whole chunks.
        ranged = not writable and getattr(loc.transaction, "ranged_reads", False) and loc.chunk_cache is None
        self._raw = raw_dtype(zarray) if ranged and spec.layout != "foreign" else None
        self._small_blocks = self._partial and _small_blocks(self.z.metadata.codecs[1])  # type: ignore[union-attr]
        self.stats = {"gets": 0, "in_flight_max": 0}  # encoded chunk fetches (non-local stores)

    def _row_reads_possible(self) -> bool:
        """Rows can be decoded alone: the array's codecs (its zarr.json, not the spec) are
        ``bytes`` (little-endian) then ``blosc`` and nothing else."""
        if _GETITEM is None or self.spec.row_bytes == 0:
            return False
        try:
            codecs = self.z.metadata.codecs  # type: ignore[union-attr]  # zarr v2 metadata has none: below
        except AttributeError:
            return False
        if len(codecs) != 2 or not isinstance(codecs[0], zarr.codecs.BytesCodec):
            return False
        endian = getattr(codecs[0].endian, "value", codecs[0].endian)  # None for one-byte dtypes
        return endian in (None, "little") and isinstance(codecs[1], zarr.codecs.BloscCodec)

    def _decode_chunks(self, plain: list[int]) -> dict[int, np.ndarray]:
        """Decode whole chunks ``plain`` from their files: blosc frames (rows decodable alone)
        here, the others through zarr (:meth:`DecodedChunks._decode_chunks`)."""
        if not self._partial:
            return super()._decode_chunks(plain)
        out: dict[int, np.ndarray] = {}
        # Blosc frames are fetched together (concurrently on a remote store) and decoded here.
        frames = self._get_frames(plain, keep=False)
        for k in plain:
            f = frames[k]
            if f is not None:
                chunk = self._empty_chunk()
                self._decode_rows(f, k, 0, self.C, chunk.ctypes.data)
                out[k] = chunk
        out.update(super()._decode_chunks([k for k in plain if k not in out]))
        return out


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
            self._forget_frames([k])
            pos += take

    def gather(self, phys: np.ndarray) -> np.ndarray:
        ks = phys // self.C
        if self._raw is not None:
            return self._gather_ranges(phys, ks)
        limit = min(ROW_READS_ABOVE_BYTES, SMALL_BLOCK_ROW_READS_ABOVE_BYTES) if self._small_blocks else ROW_READS_ABOVE_BYTES
        if not self._partial or self.allocated * self._rb <= limit:
            # A field that fits the decoded cache is served from whole cached chunks.
            return self._gather_whole(phys, ks)
        # Rows of chunks held decoded (dirty, staged or cached) come from there; so do chunks a
        # batch wants many rows of (a scan decodes whole chunks, as before).  The others are
        # decoded from their frames, a block per row (trajstore.storage.fields._rowblocks).
        rowwise = self._rowwise(ks)
        if rowwise is not None and not len(rowwise):
            return self._gather_whole(phys, ks)
        out = new_rows((len(phys), *self.spec.row_shape), self.spec.dtype)
        whole = self._frames.decode_into(out, phys, ks, rowwise)
        if rowwise is not None:
            whole = np.union1d(whole, np.setdiff1d(np.arange(len(phys)), rowwise, assume_unique=True))
        if len(whole):
            with temporary_rows():  # a temporary: not in the caller's memory
                out[whole] = self._gather_whole(phys[whole], ks[whole])
        return out

    def _gather_ranges(self, phys: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """Rows ``phys`` (chunks ``ks``) of raw chunks: each dense run of rows of a chunk not held
        decoded fetched alone as one byte range; the other rows through whole decoded chunks."""
        assert self._raw is not None
        runs = [r for r in dense_runs(phys, ks) if r[0] not in self._cache and r[0] not in self._override]
        if not runs:
            return self._gather_whole(phys, ks)
        rb, C = self._rb, self.C
        keys = [chunk_key(self.spec.array_path, k, self._ndim) for k, _, _, _ in runs]
        got = get_ranges(self.loc, [(key, (lo - k * C) * rb, (hi - k * C) * rb)
                                    for key, (k, lo, hi, _) in zip(keys, runs)], self.stats)
        out = np.empty((len(phys), *self.spec.row_shape), dtype=self.spec.dtype)
        rest = np.ones(len(phys), bool)
        for key, (k, lo, hi, pos), data in zip(keys, runs, got):
            if data is None:
                continue  # read whole below: a missing chunk of committed rows is damage, else fill values
            if len(data) != (hi - lo) * rb:
                raise DamagedStoreError(f"{self.loc.url}/{key}: rows {lo}..{hi - 1} (physical) are {(hi - lo) * rb} "
                                        f"bytes; the chunk returned {len(data)} of them (a short chunk)")
            block = np.frombuffer(data, self._raw).reshape(hi - lo, *self.spec.row_shape)
            out[pos] = block[phys[pos] - lo]
            rest[pos] = False
        if rest.any():
            sel = np.flatnonzero(rest)
            out[sel] = self._gather_whole(phys[sel], ks[sel])
        return out

    def _rowwise(self, ks: np.ndarray) -> np.ndarray | None:
        """Positions of the rows of chunks ``ks`` to decode from frames (None: all of them): not
        those of chunks held decoded or staged, nor of chunks the batch wants more than
        WHOLE_CHUNK_SHARE of."""
        most = max(1, int(self.C * WHOLE_CHUNK_SHARE))
        held = [*self._cache, *self._override]
        if len(ks) <= most and not held:
            return None
        keep = np.ones(len(ks), bool)
        if held:
            keep &= ~np.isin(ks, np.fromiter(held, np.int64, len(held)))
        if len(ks) > most:
            _u, inv, counts = np.unique(ks, return_inverse=True, return_counts=True)
            keep &= counts[inv] <= most
        return np.flatnonzero(keep)

    # -- encoded frames (row reads) ------------------------------------------------------------
    def _decode_rows(self, frame: _Frame, k: int, off: int, n: int, dest: int) -> None:
        """Decode rows ``off .. off+n`` of chunk ``k`` from ``frame`` into the address ``dest``."""
        rb, ts = self._rb, frame.typesize
        lo, hi = off * rb, (off + n) * rb
        if lo % ts == 0 and hi % ts == 0:
            got, want = _GETITEM(frame.addr, lo // ts, (hi - lo) // ts, dest), hi - lo  # type: ignore[misc]
        else:  # items of several small rows (typesize = row bytes x 2^n): decode whole items, copy the rows
            i0, i1 = lo // ts, -(-hi // ts)
            tmp = np.empty((i1 - i0) * ts, np.uint8)
            got, want = _GETITEM(frame.addr, i0, i1 - i0, tmp.ctypes.data), len(tmp)  # type: ignore[misc]
            if got == want:
                ctypes.memmove(dest, tmp.ctypes.data + lo - i0 * ts, hi - lo)
        if got != want:
            raise DamagedStoreError(f"{self.loc.url}: {self.spec.array_path}: rows {k * self.C + off}..{k * self.C + off + n - 1} "
                                    f"(physical; chunk {k}) do not decode (blosc_getitem returned {got}); run `trajstore verify`")

    def _get_frames(self, ks: list[int], keep: bool = True) -> dict[int, _Frame | None]:
        """The encoded frames of chunks ``ks`` (cached unless not ``keep``; fetched concurrently from
        a remote store); None for a chunk that is read whole instead (missing file, not a blosc 1
        frame)."""
        return self._frames.get(ks, keep)

    def _read_frames(self, ks: list[int]) -> list[tuple[np.ndarray | None, object]]:
        """The encoded files of chunks ``ks`` (:meth:`_read_encoded`)."""
        return self._read_encoded([chunk_key(self.spec.array_path, k, self._ndim) for k in ks], self.C * self._rb)

    def _read_encoded(self, keys: list[str], nbytes: int) -> list[tuple[np.ndarray | None, object]]:
        """Chunk files ``keys`` (of at most about ``nbytes``) as uint8 arrays and the object that
        owns their memory: memory-mapped (local), else fetched concurrently; ``(None, None)`` for a
        missing file (and, locally, an empty or implausibly large one)."""
        if self.loc.is_local:
            return [self._map(key, nbytes) for key in keys]
        blobs = self.loc.get_many(keys, limit=nbytes + (nbytes >> 4) + 4096, stats=self.stats)
        return [(None if b is None else np.frombuffer(b, np.uint8), b) for b in blobs]

    def _map(self, key: str, nbytes: int) -> tuple[np.ndarray | None, object]:
        """The chunk file ``key`` memory-mapped read-only (:func:`map_file`); small-block frames
        with their page tables filled (random rows touch every page of them: a 1e7-row (17,)
        float32 field faulted 64 KiB at a time took 1.85x the time per batch of a 1e6-row one)."""
        return map_file(self.loc, key, nbytes, populate=self._small_blocks)

    def _forget_frames(self, ks: list[int] | None = None) -> None:
        self._frames.forget(ks)

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        return gather_windows_by_rows(self, phys, length)

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:  # decoded: always a copy
        if not self._partial or hi - lo <= 0 or self.allocated * self._rb <= ROW_READS_ABOVE_BYTES:
            return self.gather(np.arange(lo, hi))
        # A scan of a big field: each chunk decoded straight into the result from its encoded
        # frame (mapped or fetched, 256 chunks at a time), without filling the decoded cache.
        out = np.empty((hi - lo, *self.spec.row_shape), dtype=self.spec.dtype)
        C, base = self.C, out.ctypes.data
        ks = list(range(lo // C, (hi - 1) // C + 1))
        for g in range(0, len(ks), 256):
            group = ks[g : g + 256]
            frames = self._get_frames([k for k in group if k not in self._cache and k not in self._override])
            for k in group:
                a, b = max(lo, k * C), min(hi, (k + 1) * C)
                f = frames.get(k)
                if f is None:
                    out[a - lo : b - lo] = self._chunks([k])[k][a - k * C : b - k * C]
                else:
                    self._decode_rows(f, k, a - k * C, b - a, base + (a - lo) * self._rb)
        return out

    def read_chunk(self, k: int) -> np.ndarray:
        return self._chunks([k])[k].copy()

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        return edit_chunk(self, k, offs, values, src)

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        key = chunk_key(self.spec.array_path, k, self._ndim)
        try:
            staged = self._staging_array(prefix)
            hi = min((k + 1) * self.C, staged.shape[0])
            staged[k * self.C : hi] = data[: hi - k * self.C]
        except OSError as e:
            raise _full_disk(e, f"{self.loc.url}/{prefix}/{key}", f"stage chunk {k} of {self.spec.array_path}")
        return key

    def staging_meta(self, prefix: str) -> None:
        """This field's ``zarr.json`` under the staging ``prefix`` (so staged chunks decode alike)."""
        meta_key = f"{prefix}/{self.spec.array_path}/zarr.json"
        if not self.loc.exists(meta_key):
            self.loc.put(meta_key, self.loc.get(f"{self.spec.array_path}/zarr.json") or b"")

    def _staging_array(self, prefix: str) -> zarr.Array[Any]:
        """A zarr array with this field's metadata under ``prefix`` (so staged chunks decode alike)."""
        self.staging_meta(prefix)
        staged = zarr.open_array(self.loc.zstore, path=f"{prefix}/{self.spec.array_path}", mode="r+" if self.writable else "r")
        staged = sized_array(staged, self.allocated)  # the copied zarr.json records the published rows only
        # Roll-forward moves every staged key into place, so even an all-zero chunk must be written.
        return staged.with_config({"write_empty_chunks": True})

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Forget cached copies of ``ks``; with ``prefix``, read them from the staging area."""
        self._forget_frames(ks)
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

    def reload(self) -> None:
        """Nothing to reopen: chunks are fetched by key (:meth:`drop_cache` forgets cached ones)."""

    def drop_cache(self) -> None:
        """Forget clean cached chunks (another process may have rewritten them)."""
        self._forget_frames()
        if self.loc.chunk_cache is not None:
            self.loc.chunk_cache.invalidate()  # entries are per commit record: fetch it again
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
                self._write_chunk(k, hi)
            except OSError as e:
                raise _full_disk(e, self._where(chunk_key("", k, self._ndim).lstrip("/")),
                                 f"write chunk {k} of {self.spec.array_path}")
            self._dirty.discard(k)
            self._forget_frames([k])
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

    def _write_chunk(self, k: int, hi: int) -> None:
        """Write decoded chunk ``k`` (rows up to ``hi``) out whole."""
        # zarr writes the chunk to a temp file and renames it (removing the temp on error):
        # a failed write leaves the old chunk whole, and it stays dirty for the next flush.
        self.z[k * self.C : hi] = self._cache[k][: hi - k * self.C]

    def close(self) -> None:
        self._cache.clear()
        self._forget_frames()
