"""Random rows of blosc-compressed chunks, each decoded from the one small block that holds it.

A blosc 1 frame (zarr's ``blosc`` codec output for a chunk) is a header, a table of block offsets
and independently compressed blocks, so ``blosc_getitem`` decodes a row by decoding its block
only (:mod:`trajstore.storage.fields._blosc`).  Two things decide what a random row costs:

* The block size c-blosc really writes.  For lz4 (and blosclz) with a ``typesize`` of at most 16,
  c-blosc splits each block into ``typesize`` byte streams and then enlarges the block to
  ``blocksize * typesize``, at least 64 KiB (``compute_blocksize``, "Enlarge the blocksize for
  splittable codecs").  A (17,) float32 field declared with ``typesize`` 4 and 16 KiB blocks had
  64 KiB blocks: a random row decoded 964 rows (28 us), so a ``sample(256)`` took 7.3 ms.  New lz4
  fields of small rows are declared with a ``typesize`` above 16 (:func:`small_rows_codec`), which
  c-blosc never splits, so the block size asked for is the one written (2 KiB: 32 rows of 68 bytes).
* What Python does per row.  :class:`FrameCache` keeps each chunk's frame address in a numpy
  table indexed by chunk number, so a batch's job list is a few numpy operations, and the
  ``blosc_getitem`` calls run in one ``map`` (no Python bytecode per row).

Frames are input: :func:`~trajstore.storage.fields._blosc.check_frame` refuses a header or block
offset that points outside the frame before c-blosc sees it, and c-blosc 1.21 checks each block's
compressed length against the frame's (``blosc_d``); a failure is a DamagedStoreError naming the
field and the row.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import numpy as np
import zarr
import zarr.codecs  # (zarr imports it; named so a type checker sees zarr.codecs)

from trajstore.errors import DamagedStoreError
from trajstore.storage.fields._blosc import GETITEM, Frame, check_frame

__all__ = ["MAPS", "SMALL_BLOCK_BYTES", "SMALL_ROWS_LZ4_BLOCK_BYTES", "FrameCache", "MapBudget", "small_blocks",
           "small_rows_codec", "unsplit_typesize"]

#: lz4 fields of small rows (new stores): blocks of about this many bytes.  A random row decodes
#: one block: 2 KiB is 32 rows of (17,) float32 and a whole number of c-blosc's AVX2 unshuffle
#: tiles (32 elements of ``typesize``); see docs/format.md for the measurements.
SMALL_ROWS_LZ4_BLOCK_BYTES = 2 << 10
#: Blocks of at most this many bytes are cheap enough to decode per row at any field size (not
#: zstd's 16 KiB blocks of small rows: those fields keep whole cached chunks up to 128 MiB).
SMALL_BLOCK_BYTES = 4 << 10
#: c-blosc splits blocks of lz4/blosclz with a typesize of at most this (then enlarges them).
_MAX_SPLITS = 16
_MAX_TYPESIZE = 255
_HEADER, _MEMCPYED = 16, 0x02

#: ``read(chunks) -> [(uint8 array or None, owner of its memory)]``: the encoded chunk files.
Reader = Callable[[list[int]], list[tuple[np.ndarray | None, object]]]


def _max_map_count() -> int:
    """Linux's limit on a process's memory mappings (``vm.max_map_count``; 65,530 by default)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def _address_space() -> int:
    """The process's address-space limit (``RLIMIT_AS``) in bytes; ``2**62`` when it has none."""
    try:
        import resource  # (POSIX only: elsewhere no address-space limit is read)
    except ImportError:  # pragma: no cover - Windows
        return 1 << 62
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return 1 << 62 if soft in (resource.RLIM_INFINITY, -1) else int(soft)


class MapBudget:
    """The process-wide bound on encoded chunk files kept memory-mapped as frames: all fields of all
    local stores of this process share it (:class:`FrameCache` of a local field).

    A mapped frame costs one memory mapping (the process may have ``vm.max_map_count`` of them,
    raw fields' chunk files and every library included) and address space, not RAM: its pages
    are the page cache's.  A cache keeps a new frame only within the budget, dropping its own
    oldest frames first; where it has none left to drop, the frame serves the read that mapped
    it and is unmapped after.  So at most ``max_frames`` frames / ``max_bytes`` bytes stay mapped,
    plus those of the reads in progress.

    Parameters
    ----------
    max_frames : int
        Frames kept mapped, at most.
    max_bytes : int
        Bytes of address space they take, at most (each frame is at most about its chunk's
        decoded size: larger files are never mapped).
    """

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.frames = self.nbytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Count one more frame of ``nbytes`` bytes if the budget allows it; whether it did."""
        with self._lock:
            if self.frames >= self.max_frames or self.nbytes + nbytes > self.max_bytes:
                return False
            self.frames += 1
            self.nbytes += nbytes
            return True

    def give(self, frames: int, nbytes: int) -> None:
        """Return ``frames`` frames of ``nbytes`` bytes in all (unmapped)."""
        with self._lock:
            self.frames -= frames
            self.nbytes -= nbytes


#: Local fields' mapped frames: a quarter of the process's mappings (16,382 by default: a field of
#: 4,096-row chunks keeps every frame of 67 M rows mapped, where a bound of 4,096 frames per field
#: made a 10 M-row field's random batches map and unmap frames once it passed 16.7 M rows, 0.1 ms
#: to 4 ms per sample(256) at 2.4x the bound), and at most 16 GiB or a quarter of ``RLIMIT_AS``.
MAPS = MapBudget(max(4096, _max_map_count() // 4), min(16 << 30, _address_space() // 4))


def unsplit_typesize(itemsize: int, row_bytes: int) -> int | None:
    """A blosc ``typesize`` that c-blosc never splits, for rows of ``row_bytes`` bytes.

    Parameters
    ----------
    itemsize : int
        The dtype's item size: the ``typesize`` is a multiple of it, so a byte shuffle still
        groups bytes of the same significance.
    row_bytes : int
        Bytes of one row (a multiple of ``itemsize``).

    Returns
    -------
    int or None
        Rows of at most 16 bytes: ``row_bytes`` times the smallest power of two above 16 (rows
        share an item); else the largest divisor of ``row_bytes`` in 17..255 that is a multiple of
        ``itemsize`` (the row itself when it fits); None if there is none.
    """
    if row_bytes <= _MAX_SPLITS:
        ts = row_bytes
        while ts <= _MAX_SPLITS:
            ts *= 2
        return ts
    return next((t for t in range(min(row_bytes, _MAX_TYPESIZE), _MAX_SPLITS, -1)
                 if row_bytes % t == 0 and t % itemsize == 0), None)


def small_rows_codec(level: int, dtype: np.dtype, row_bytes: int) -> zarr.codecs.BloscCodec | None:
    """The blosc lz4 codec of a new field of ``row_bytes``-byte rows (under 4 KiB): ``typesize``
    above 16 so that c-blosc keeps the block size asked for, blocks of whole rows of about
    :data:`SMALL_ROWS_LZ4_BLOCK_BYTES`; None when no such ``typesize`` exists (the caller keeps
    blosc's own layout).

    Parameters
    ----------
    level : int
        lz4 ``clevel``.
    dtype : numpy.dtype
        The field's dtype: the byte shuffle works on groups of its item size.
    row_bytes : int
        Bytes of one row.

    Returns
    -------
    zarr.codecs.BloscCodec or None
        ``shuffle`` is ``"shuffle"`` for multi-byte dtypes (``typesize`` a multiple of the item
        size, so bytes of the same significance are grouped), ``"noshuffle"`` for one-byte dtypes.
    """
    ts = unsplit_typesize(dtype.itemsize, row_bytes)
    if ts is None:
        return None
    unit = math.lcm(ts, row_bytes)  # blocks of whole rows and whole items
    tile = math.lcm(unit, 32 * ts)  # ... and of whole AVX2 unshuffle tiles (32 items), where that fits
    if tile <= 2 * SMALL_ROWS_LZ4_BLOCK_BYTES:
        unit = tile
    block = max(1, -(-SMALL_ROWS_LZ4_BLOCK_BYTES // unit)) * unit
    shuffle: Literal["shuffle", "noshuffle"] = "shuffle" if dtype.itemsize > 1 else "noshuffle"
    return zarr.codecs.BloscCodec(cname="lz4", clevel=level, shuffle=shuffle, typesize=ts, blocksize=block)


def small_blocks(codec: object) -> bool:
    """Whether chunks written by the zarr blosc ``codec`` have blocks of at most
    :data:`SMALL_BLOCK_BYTES` (the size asked for, and c-blosc does not enlarge it)."""
    if not isinstance(codec, zarr.codecs.BloscCodec):
        return False
    bs, ts = int(codec.blocksize or 0), int(codec.typesize or 1)
    if bs <= 0 or bs > SMALL_BLOCK_BYTES:
        return False
    cname = getattr(codec.cname, "value", codec.cname)
    # c-blosc 1.x (BLOSC_FORWARD_COMPAT_SPLIT, its default): every codec but zstd is split then
    split = cname != "zstd" and codec.clevel > 0 and ts <= _MAX_SPLITS and bs // ts >= 128
    return not split


def _give_back(budget: MapBudget | None, mapped: list[int]) -> None:
    """Return what a cache counts against ``budget`` (``mapped``: [frames, bytes]; zeroed)."""
    if budget is not None and mapped[0]:
        budget.give(mapped[0], mapped[1])
    mapped[0] = mapped[1] = 0


class _Memory:
    """Read-only bytes ``lo .. hi`` of this process's memory, for :func:`numpy.asarray`."""

    def __init__(self, lo: int, hi: int) -> None:
        self.__array_interface__ = {"data": (lo, True), "shape": (hi - lo,), "typestr": "|u1", "version": 3}


def _span(lo: int, hi: int) -> np.ndarray:
    """The addresses ``lo .. hi`` as a read-only uint8 array, to gather a batch's rows from frames
    mapped anywhere between them in one fancy index (one numpy call, not one copy per row).  Only
    the bytes indexed are read: the caller indexes rows inside frames it holds (checked: a stored
    frame holds all its rows) and never the gaps between mappings."""
    return np.asarray(_Memory(lo, hi))


class FrameCache:
    """The checked blosc frames of one field's chunks, bounded, with each frame's address and
    ``typesize`` also in numpy tables indexed by chunk (a batch looks its rows up at once).

    Parameters
    ----------
    where : str
        ``"<store url>: <array path>"``, for error messages.
    chunk_rows, row_bytes : int
        Rows of a chunk and bytes of a row (a frame decodes to ``chunk_rows * row_bytes`` bytes).
    read : Reader
        Reads encoded chunk files through the store's confined, bounded reader.
    ram : bool
        Whether a frame's bytes are held in RAM (fetched) rather than memory-mapped: only those
        count towards ``max_bytes``.
    max_frames, max_bytes : int
        Bounds of frames held in RAM: the oldest frames are dropped past them.
    budget : MapBudget, optional
        Memory-mapped frames (not ``ram``): the process-wide bound they count against (default
        :data:`MAPS`), instead of ``max_frames``.
    """

    def __init__(self, where: str, chunk_rows: int, row_bytes: int, read: Reader, ram: bool, max_frames: int,
                 max_bytes: int, budget: MapBudget | None = None) -> None:
        self.where, self.C, self.rb = where, chunk_rows, row_bytes
        self.nbytes = chunk_rows * row_bytes
        self._read, self._ram = read, ram
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self._budget = None if ram else (budget or MAPS)
        # [frames, bytes] this cache counts against the budget: given back when it is collected
        self._mapped = [0, 0]
        if self._budget is not None:
            weakref.finalize(self, _give_back, self._budget, self._mapped)
        self.frames: OrderedDict[int, Frame | None] = OrderedDict()  # chunk -> frame (None: read whole)
        self.held_bytes = 0
        self._known = np.zeros(0, bool)  # chunk -> in ``frames``
        self._addr = np.zeros(0, np.int64)  # chunk -> frame address (0: none, read the chunk whole)
        self._ts = np.zeros(0, np.int64)  # chunk -> typesize
        self._stored = np.zeros(0, bool)  # chunk -> its frame holds the rows as they are (blosc "memcpyed")
        self._owner = np.empty(0, object)  # chunk -> the Frame (a batch's references keep it alive)

    # -- the frame table -------------------------------------------------------------------
    def _grow(self, top: int) -> None:
        n = max(top, 2 * len(self._known), 64)
        for name, fill in (("_known", False), ("_addr", 0), ("_ts", 0), ("_stored", False), ("_owner", None)):
            old = getattr(self, name)
            new = np.full(n, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _cost(self, frame: Frame | None) -> int:
        return len(frame.buf) if self._ram and frame is not None else 0

    def _put(self, k: int, frame: Frame | None) -> None:
        self._drop(k)
        self.frames[k] = frame
        self.held_bytes += self._cost(frame)
        if k >= len(self._known):
            self._grow(k + 1)
        self._known[k], self._owner[k] = True, frame
        self._addr[k], self._ts[k] = (0, 0) if frame is None else (frame.addr, frame.typesize)
        # c-blosc stores a chunk it cannot compress as is, after the header (check_frame made sure
        # the file holds it all): its rows are copied, not decoded (no walk of the block table)
        self._stored[k] = frame is not None and bool(frame.buf[2] & _MEMCPYED)

    def _drop(self, k: int) -> Frame | None:
        if k not in self.frames:
            return None
        frame = self.frames.pop(k)
        self.held_bytes -= self._cost(frame)
        if self._budget is not None and frame is not None:
            self._budget.give(1, len(frame.buf))
            self._mapped[0] -= 1
            self._mapped[1] -= len(frame.buf)
        self._known[k], self._addr[k], self._ts[k], self._stored[k], self._owner[k] = False, 0, 0, False, None
        return frame

    def forget(self, ks: list[int] | None = None) -> None:
        """Drop the frames of chunks ``ks`` (None: all of them)."""
        if ks is None:
            self.frames.clear()
            self.held_bytes = 0
            _give_back(self._budget, self._mapped)
            self._known[:], self._addr[:], self._ts[:], self._stored[:], self._owner[:] = False, 0, 0, False, None
            return
        for k in ks:
            self._drop(k)

    def _check(self, k: int, buf: np.ndarray | None, owner: object) -> Frame | None:
        """The frame of chunk ``k`` once its header and offsets are checked; None when it is read
        whole instead (missing file, not a blosc 1 frame, items that do not tile its rows)."""
        if buf is None:
            return None
        try:
            ts = check_frame(buf, self.nbytes)
        except ValueError as e:
            raise DamagedStoreError(f"{self.where}: chunk {k} (rows {k * self.C}..{(k + 1) * self.C - 1}, physical) "
                                    f"is not a valid blosc frame ({e})") from None
        if ts is None or not (self.rb % ts == 0 or (ts % self.rb == 0 and self.nbytes % ts == 0)):
            return None
        return Frame(buf, ts, owner)

    def get(self, ks: list[int], keep: bool = True) -> dict[int, Frame | None]:
        """The frames of chunks ``ks`` (read now for those not held; kept unless not ``keep``);
        None for a chunk read whole instead.  The oldest other frames are dropped past the bounds
        (a batch that needs more frames than they allow holds them until it is done)."""
        out: dict[int, Frame | None] = {}
        missing = []
        for k in ks:
            if k in self.frames:
                self.frames.move_to_end(k)
                out[k] = self.frames[k]
            else:
                missing.append(k)
        if not missing:
            return out
        for k, (buf, owner) in zip(missing, self._read(missing)):
            frame = self._check(k, buf, owner)
            out[k] = frame
            if keep:
                self._keep(k, frame, out)
        if self._ram and (len(self.frames) > self.max_frames or self.held_bytes > self.max_bytes):
            # the oldest first, never a frame this call asked for (a batch's rows keep their frames)
            for k in [k for k in self.frames if k not in out]:
                if len(self.frames) <= self.max_frames and self.held_bytes <= self.max_bytes:
                    break
                self._drop(k)
        return out

    def _keep(self, k: int, frame: Frame | None, wanted: dict[int, Frame | None]) -> None:
        """Keep the frame of chunk ``k``; a mapped one only within the budget, for which this
        cache's oldest mapped frames not ``wanted`` by the read in progress are unmapped first
        (none left: it is not kept, and goes with the read)."""
        if self._budget is not None and frame is not None:
            self._drop(k)
            size = len(frame.buf)
            while not self._budget.take(size):
                victim = next((j for j, f in self.frames.items() if f is not None and j not in wanted), None)
                if victim is None:
                    return
                self._drop(victim)
            self._mapped[0] += 1
            self._mapped[1] += size
        self._put(k, frame)

    # -- rows ------------------------------------------------------------------------------
    def decode_into(self, out: np.ndarray, phys: np.ndarray, ks: np.ndarray, which: np.ndarray | None = None) -> np.ndarray:
        """Decode rows ``phys[i]`` (chunk ``ks[i]``) into ``out[i]`` for every ``i`` of ``which``
        (None: all), each from the block that holds it.

        Parameters
        ----------
        out : numpy.ndarray
            (B, *row shape), C-contiguous, the field's dtype.
        phys, ks : numpy.ndarray
            (B,) int64 physical rows and their chunks.
        which : numpy.ndarray, optional
            Positions to decode.

        Returns
        -------
        numpy.ndarray
            The positions of ``which`` whose chunk is read whole instead (no usable frame), int64.

        Raises
        ------
        DamagedStoreError
            A frame that is not a valid blosc frame, or a row whose block does not decode.
        """
        idx = np.arange(len(phys)) if which is None else which
        if len(idx) == 0:
            return idx
        kk = ks if which is None else ks[which]
        top = int(kk.max()) + 1
        if top > len(self._known):
            self._grow(top)
        known = self._known[kk]
        if not known.all():
            self.get(sorted(set(kk[~known].tolist())))
        keep = self._owner[kk]  # references: these frames stay mapped until the batch is decoded
        addr, ts = self._addr[kk], self._ts[kk]
        ok = addr != 0
        if not ok.all():
            sel = np.flatnonzero(ok)
            idx, kk, addr, ts, keep = idx[sel], kk[sel], addr[sel], ts[sel], keep[sel]
            whole = (np.arange(len(phys)) if which is None else which)[~ok]
        else:
            whole = np.zeros(0, np.int64)
        if len(idx):
            stored = self._stored[kk]
            if stored.all():  # (the usual case for incompressible data: no selections)
                self._copy_stored(out, phys if which is None and len(idx) == len(phys) else phys[idx], kk, addr, idx)
                idx = idx[:0]
            elif stored.any():
                sel = np.flatnonzero(stored)
                self._copy_stored(out, phys[idx[sel]], kk[sel], addr[sel], idx[sel])
                sel = np.flatnonzero(~stored)
                idx, kk, addr, ts = idx[sel], kk[sel], addr[sel], ts[sel]
        if len(idx):
            self._decode(out, phys[idx], kk, addr, ts, idx)
        del keep
        return whole

    def _copy_stored(self, out: np.ndarray, rows: np.ndarray, kk: np.ndarray, addr: np.ndarray, idx: np.ndarray) -> None:
        """Rows ``rows`` of stored frames (at ``addr``) into ``out[idx]``: one numpy index for all."""
        rb = self.rb
        src = addr + (_HEADER - kk * self.C * rb) + rows * rb
        lo = int(src.min())
        flat = out.reshape(len(out), -1).view(np.uint8)
        # every byte offset as the start of a row (stride 1): one row-wise fancy index (a copy of rb
        # bytes per row), not a byte-wise one (5x slower)
        rows_at = np.lib.stride_tricks.as_strided(_span(lo, int(src.max()) + rb), (int(src.max()) - lo + 1, rb), (1, 1))
        flat[idx] = rows_at[src - lo]

    def _decode(self, out: np.ndarray, rows: np.ndarray, kk: np.ndarray, addr: np.ndarray, ts: np.ndarray,
                idx: np.ndarray) -> None:
        """``blosc_getitem`` for each row: straight into ``out`` where items tile the row (typesize
        divides the row), else its item into a scratch array, then the row's bytes out of it."""
        rb, getitem = self.rb, GETITEM
        assert getitem is not None  # (frames are only read where numcodecs exports it)
        byte = (rows - kk * self.C) * rb
        if int(ts.max()) <= rb:  # typesize divides the row (the usual case)
            dest = out.ctypes.data + idx * rb
            got = np.fromiter(map(getitem, addr.tolist(), (byte // ts).tolist(), (rb // ts).tolist(), dest.tolist()),
                              np.int64, len(idx))
            self._raise_bad(got != rb, got, rows, kk)
            return
        # Rows of at most 16 bytes share an item (typesize = row bytes x 2^n): decode the item.
        item = int(ts.max())
        scratch = np.empty((len(idx), item), np.uint8)
        nitems = np.where(ts > rb, 1, rb // ts)
        got = np.fromiter(map(getitem, addr.tolist(), (byte // ts).tolist(), nitems.tolist(),
                              (scratch.ctypes.data + np.arange(len(idx)) * item).tolist()), np.int64, len(idx))
        self._raise_bad(got != nitems * ts, got, rows, kk)
        at = np.where(ts > rb, byte % ts, 0)
        flat = out.reshape(len(out), -1).view(np.uint8)
        flat[idx] = scratch[np.arange(len(idx))[:, None], at[:, None] + np.arange(rb)]

    def _raise_bad(self, bad: np.ndarray, got: np.ndarray, rows: np.ndarray, kk: np.ndarray) -> None:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DamagedStoreError(f"{self.where}: row {int(rows[i])} (physical; chunk {int(kk[i])}) does not "
                                    f"decode: blosc_getitem returned {int(got[i])} ({int(bad.sum())} row(s) of this "
                                    "read failed); run `trajstore verify`")
