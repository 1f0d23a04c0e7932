"""One numpy view over many chunk files mapped into one reserved address range (Linux).

An uncompressed zarr chunk file is a raw C-order block of ``chunk_rows`` rows.  We
reserve one virtual address range for the whole field and map each chunk file at its
slot with ``MAP_FIXED``; unmapped slots are anonymous zero pages (what zarr reads
for a missing chunk).  A random gather is then a single numpy fancy index over the
page cache, which is what a plain ``np.memmap`` of one big file costs.  Chunk byte
sizes must be multiples of the page size.  Chunks smaller than a huge page tile the range
end to end (one contiguous array); larger ones start on huge-page boundaries
(:func:`slot_bytes`), so the kernel maps their 2 MiB page-cache folios in one fault each.

The system layer under it (libc through ctypes, mmap flags, page sizes, whether this process and
a store's filesystem can map files at all) is :mod:`trajstore.storage.fields._syscalls`.  Its names
are read here as attributes of that module, never imported by name: some are rebound at run time
(``POPULATE_WRITE``) or replaced by tests (``_libc``, ``HUGE``), which an imported copy would not see.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import stat
import sys
from typing import Any, Callable

import numpy as np

from trajstore.errors import ClosedError
from trajstore.storage.fields import _syscalls
from trajstore.storage.fields.out import allocating, new_rows


def _named(name: str | Callable[[], str]) -> str:
    """A file's name for an error of :meth:`VirtualArray.map_chunk`, given or built now."""
    return name if isinstance(name, str) else name()


#: ``VirtualArray.resident`` probes one page per this many bytes.
PROBE_BYTES = 1 << 20


def slot_bytes(chunk_bytes: int) -> int:
    """Address space given to one chunk: the chunk itself, rounded up to
    :data:`~trajstore.storage.fields._syscalls.HUGE` when it spans at least one.

    Why: the kernel maps a page-cache folio of ``HUGE`` bytes (a file read or written in large
    blocks gets them) with one page-table entry, on one fault, but only where the virtual address
    and the file offset agree modulo ``HUGE``.  Chunks laid end to end start at multiples of
    their own size, which for image rows (28,224 bytes for (84,84,4) uint8) never is a multiple of
    2 MiB; such chunks were mapped 64 KiB per fault (fault-around), and the first few hundred
    batches of a freshly opened store took 300 faults each where a plain ``np.memmap`` took 70.
    """
    huge = _syscalls.HUGE
    return -(-chunk_bytes // huge) * huge if chunk_bytes >= huge else chunk_bytes


class VirtualArray:
    """A reserved address range holding ``n_chunks`` chunks of ``chunk_rows`` rows, each chunk
    file mapped at its slot.

    Slots are :func:`slot_bytes` apart.  Where that equals a chunk's size the rows are one
    contiguous array (:attr:`array`); otherwise every chunk starts on a
    :data:`~trajstore.storage.fields._syscalls.HUGE` boundary and :attr:`chunks` is the only view
    (``array`` is None).  Use :meth:`take`, :meth:`windows`, :meth:`rows` and :meth:`put`, which
    serve both.

    Parameters
    ----------
    n_chunks : int
        Number of chunk slots to reserve.
    chunk_rows : int
        Rows per chunk; ``chunk_rows * row_bytes`` must be a multiple of
        :data:`~trajstore.storage.fields._syscalls.PAGE`.
    row_shape : tuple of int
        Shape of one row.
    dtype : numpy.dtype
        Element type (stored little-endian, as zarr's ``bytes`` codec writes it).
    writable : bool
        Map chunk files read-write (the writer) or read-only (readers).
    """

    def __init__(self, n_chunks: int, chunk_rows: int, row_shape: tuple[int, ...], dtype: np.dtype,
                 writable: bool) -> None:
        self.chunk_rows = chunk_rows
        self.row_shape = tuple(row_shape)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.writable = writable
        self.row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.chunk_bytes = chunk_rows * self.row_bytes
        if self.chunk_bytes % _syscalls.PAGE:
            raise ValueError(f"chunk of {self.chunk_bytes} bytes is not a multiple of the page size {_syscalls.PAGE}")
        self.n_chunks = max(int(n_chunks), 1)
        self.stride = slot_bytes(self.chunk_bytes)
        self.nbytes = self.n_chunks * self.stride
        # Reserve one HUGE more than needed, so the range can start on a HUGE boundary.
        align = _syscalls.HUGE if self.chunk_bytes >= _syscalls.HUGE else _syscalls.PAGE
        self._reserved = self.nbytes + align - _syscalls.PAGE
        flags = _syscalls.MAP_PRIVATE | _syscalls.MAP_ANON | _syscalls.MAP_NORESERVE
        at = _syscalls.libc.mmap(None, self._reserved, _syscalls.PROT_READ, flags, -1, 0)
        self._reserved_at = _syscalls.check_address(at, "reserve address range")
        self.base = -(-self._reserved_at // align) * align
        self.mapped = np.zeros(self.n_chunks, dtype=bool)
        self._probe_vec = np.zeros(1, np.uint8)  # mincore's answer for one page (resident)
        self._probe_at = self._probe_vec.ctypes.data
        buf = memoryview((ctypes.c_char * self.nbytes).from_address(self.base)).cast("B")
        # Writes must only ever reach rows of mapped, writable chunk files: anything else is
        # a read-only zero page and would crash the process, so only the writer's views are writable.
        inner = np.empty((1, *self.row_shape), self.dtype).strides[1:]  # C order within a row
        self.chunks: np.ndarray = np.ndarray((self.n_chunks, chunk_rows, *self.row_shape), self.dtype,
                                             buffer=buf, strides=(self.stride, self.row_bytes, *inner))
        self.chunks.flags.writeable = writable
        self.array: np.ndarray | None = None
        if self.stride == self.chunk_bytes:
            self.array = self.chunks.reshape((self.n_chunks * chunk_rows, *self.row_shape))
        # Every byte of the range, for the window pre-touch in :meth:`windows`.
        self._bytes: np.ndarray = np.ndarray((self.nbytes,), np.uint8, buffer=buf)
        # For :meth:`take` where chunks are apart: every row as one opaque element, at every
        # ``itemsize`` step of the range (elements overlap; row ``r`` of chunk ``k`` is element
        # ``(k * stride + r * row_bytes) / itemsize``).  A gather copies one element per row, half
        # the work of numpy's row-by-row gather of ``chunks[k, r]``.
        self._unit = self.dtype.itemsize
        self._row_units = self.row_bytes // self._unit
        self._gap_units = (self.stride - self.chunk_bytes) // self._unit  # after each chunk (a whole number of pages)
        self._rows_at: np.ndarray = np.ndarray(((self.nbytes - self.row_bytes) // self._unit + 1,),
                                               np.dtype((np.void, self.row_bytes)), buffer=buf, strides=(self._unit,))

    def take(self, phys: np.ndarray) -> np.ndarray:
        """Copies of rows ``phys`` (B,) int64: (B, *row_shape)."""
        if phys.dtype != np.int64:
            phys = phys.astype(np.int64)  # (units below overflow 32 bits)
        if self.array is not None:
            if allocating(len(phys) * self.row_bytes) and len(phys) and phys.min() >= 0 and phys.max() < len(self.array):
                # Into new_rows' memory (rows_into's, or recycled); the rows are in range, so "clip" never clips
                # (and, unlike "raise", does not gather into a temporary first).
                out = new_rows((len(phys), *self.row_shape), self.dtype)
                return np.take(self.array, phys, axis=0, out=out, mode="clip")
            return self.array.take(phys, axis=0)  # (a contiguous take: a third of array[phys]'s work; out-of-range rows raise IndexError)
        # One opaque element per row (see __init__): about 60% of ``chunks[k, r]``'s instructions
        # for 256 (17,) float32 rows, index arithmetic included (np.divmod alone cost a quarter).
        at = phys * self._row_units
        at += phys // self.chunk_rows * self._gap_units
        return self._rows_at[at].view(self.dtype).reshape(len(phys), *self.row_shape)

    def rows(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        """A copy of rows ``[lo, hi)``; ``copy=False``: a read-only view where they lie in one
        chunk (or the range is contiguous), else a copy."""
        if not copy and (self.array is not None or lo // self.chunk_rows == (hi - 1) // self.chunk_rows):
            k = lo // self.chunk_rows
            view = self.array[lo:hi] if self.array is not None else \
                self.chunks[k, lo - k * self.chunk_rows : hi - k * self.chunk_rows]
            view.flags.writeable = False  # a view of a writer's mapping: reads only
            return view
        if self.array is not None:
            return self.array[lo:hi].copy()
        out = np.empty((hi - lo, *self.row_shape), self.dtype)
        for k, off, pos, n in self._pieces(lo, hi - lo):
            out[pos : pos + n] = self.chunks[k, off : off + n]
        return out

    def put(self, lo: int, data: np.ndarray) -> None:
        """Store ``data`` (n, *row_shape) into rows ``[lo, lo + n)``; their chunks must be mapped writable."""
        if self.array is not None:
            self.array[lo : lo + len(data)] = data
            return
        for k, off, pos, n in self._pieces(lo, len(data)):
            self.chunks[k, off : off + n] = data[pos : pos + n]

    def block(self, lo: int, hi: int) -> np.ndarray | None:
        """A view of rows ``[lo, hi)`` (writable in the writer's array), or None where they do not
        lie in one chunk and chunks are apart (:attr:`array` is None)."""
        if self.array is not None:
            return self.array[lo:hi]
        k = lo // self.chunk_rows
        if (hi - 1) // self.chunk_rows != k:
            return None
        return self.chunks[k, lo - k * self.chunk_rows : hi - k * self.chunk_rows]

    def _address(self, row: int) -> int:
        k, r = divmod(row, self.chunk_rows)
        return self.base + k * self.stride + r * self.row_bytes

    def holds(self, lo: int, data: np.ndarray) -> bool:
        """``data`` is rows ``[lo, lo + len(data))`` of this array themselves (a :meth:`block`
        view of them): storing it there would copy every byte onto itself."""
        ai = data.__array_interface__
        return (ai["data"][0] == self._address(lo) and data.dtype == self.dtype and data.shape[1:] == self.row_shape
                and data.flags.c_contiguous and self.block(lo, lo + len(data)) is not None)

    def _page_range(self, lo: int, hi: int) -> tuple[int, int]:
        """Addresses of the first and past the last page holding rows ``[lo, hi)`` (one chunk)."""
        page = _syscalls.PAGE
        return self._address(lo) & ~(page - 1), -(-(self._address(hi - 1) + self.row_bytes) // page) * page

    def resident(self, lo: int, hi: int) -> bool:
        """The pages of rows ``[lo, hi)`` (one chunk, mapped) are in the page cache, judged by
        ``mincore`` of one page per :data:`PROBE_BYTES` and the last: a store into a page that is
        not reads it from disk first, where ``pwrite`` of whole pages reads nothing.  (Pages leave
        the page cache in folios and regions; every page's lookup cost 0.13-0.25 ms a block.)"""
        start, end = self._page_range(lo, hi)
        vec, out = self._probe_vec, self._probe_at
        last = end - _syscalls.PAGE
        for at in (*range(start, last, PROBE_BYTES), last):
            if _syscalls.libc.mincore(at, _syscalls.PAGE, out) != 0 or not vec[0] & 1:
                return False  # (mincore failed: nothing is known, take the path that reads nothing)
        return True

    def populate(self, lo: int, hi: int) -> bool:
        """Fault in the pages of rows ``[lo, hi)`` (one chunk, mapped writable) ready for writing,
        in one ``madvise(MADV_POPULATE_WRITE)`` call; False where the kernel does not support it.

        Why: the first store into each page of a shared file mapping faults, also after writeback
        cleaned it (ext4's ``page_mkwrite``): 18-26 us per (84,84,4) row, row by row; 256 rows
        populated in one call take 0.3-0.6 ms where the page cache holds HUGE folios.  The pages
        are unmapped first (``MADV_DONTNEED``; the data stays in the page cache): a HUGE folio
        mapped read-only (by this process's reads, or by writeback) takes a write fault by
        splitting its mapping and faulting each page (1.2-1.6 ms per 256 rows); from nothing it is
        mapped writable whole.  Pages still mapped writable lose by it (0.04 -> 0.4 ms), but a
        training loop laps a ring slower than writeback cleans it (scripts/bench_images.py FINDINGS).

        Raises
        ------
        OSError
            The pages cannot be faulted in: ``EFAULT`` (the file is shorter than its mapping:
            a store there would have been ``SIGBUS``), ``ENOMEM``, ``EIO``.
        """
        if not _syscalls.populate_write_works():
            return False
        start, end = self._page_range(lo, hi)
        if self.stride % _syscalls.HUGE == 0:
            _syscalls.libc.madvise(start, end - start, _syscalls.MADV_DONTNEED)
        while _syscalls.libc.madvise(start, end - start, _syscalls.MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in _syscalls.ADVICE_UNSUPPORTED:
                _syscalls.POPULATE_WRITE = False
                return False
            raise OSError(err, f"prepare rows {lo}..{hi - 1} for writing: {os.strerror(err)}")
        return True

    def _pieces(self, lo: int, n: int) -> list[tuple[int, int, int, int]]:
        """``(chunk, row in chunk, position in the block, rows)`` of each chunk that rows
        ``[lo, lo + n)`` touch."""
        out, pos = [], 0
        while pos < n:
            k, off = divmod(lo + pos, self.chunk_rows)
            take = min(self.chunk_rows - off, n - pos)
            out.append((k, off, pos, take))
            pos += take
        return out

    def windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """Copies of ``length`` consecutive rows from each of ``phys`` (B,): (B, length, ...); every
        window must end within the range.

        Each window is one element of a ``void`` view whose elements overlap (stride one row), so
        numpy copies it with one ``memcpy``: far fewer page-table walks and cache misses than
        gathering B x length rows.  A first pass loads the first and last byte of every window:
        those loads are independent, so the page walks and cache misses of all windows overlap
        instead of stalling one window's copy after another (on a store far larger than the
        caches this halves the memory stalls; docs/benchmarks.md).  Where chunks are apart
        (:attr:`array` is None), the windows that run into the next chunk are gathered row by row.
        """
        rb, window, C = self.row_bytes, length * self.row_bytes, self.chunk_rows
        vtype = np.dtype((np.void, window))
        if self.array is not None:
            at = phys * rb
            view = np.ndarray((self.n_chunks * C - length + 1,), vtype, buffer=self._bytes, strides=(rb,))
            self._bytes.take(np.concatenate([at, at + (window - 1)]))
            return view[phys].view(self.dtype).reshape(len(phys), length, *self.row_shape)
        if length > C:
            return self.take((phys[:, None] + np.arange(length)).ravel()).reshape(len(phys), length, *self.row_shape)
        k, r = np.divmod(phys, C)
        # Windows that run into the next chunk are gathered as the last window of their own chunk,
        # then replaced row by row: one gather for all, a few rows more for those.
        rr = np.minimum(r, C - length)
        at = k * self.stride + rr * rb
        self._bytes.take(np.concatenate([at, at + (window - 1)]))
        view = np.ndarray((self.n_chunks, C - length + 1), vtype, buffer=self._bytes, strides=(self.stride, rb))
        out = view[k, rr].view(self.dtype).reshape(len(phys), length, *self.row_shape)
        across = np.flatnonzero(rr != r)
        if len(across):
            rows = phys[across, None] + np.arange(length)
            out[across] = self.take(rows.ravel()).reshape(len(across), length, *self.row_shape)
        return out

    def map_chunk(self, k: int, fd: int, name: str | Callable[[], str], st: os.stat_result | None = None) -> None:
        """Map the open chunk file ``fd`` as chunk ``k``, replacing whatever was mapped there.  The
        caller opened it without following links and keeps ownership of ``fd`` (a mapping
        outlives its descriptor).  ``name``: the file's name in errors, or a function giving it
        (built only for an error: a store's first read maps hundreds of files).  ``st``: the
        caller's ``fstat`` of ``fd`` if it has one (else it is asked here).

        Raises
        ------
        EOFError
            The file is not a regular file, or shorter than a chunk (mapping past its end would
            ``SIGBUS`` on access).
        OSError
            ``mmap`` failed.
        """
        self._check_open()
        if st is None:
            st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EOFError(f"chunk file {_named(name)!r} is not a regular file; not mapped")
        if st.st_size < self.chunk_bytes:
            raise EOFError(f"chunk file {_named(name)!r} holds {st.st_size} bytes; expected {self.chunk_bytes}")
        # A file with holes (they grow with the rows) is mapped as it is: the writer allocates the
        # blocks under rows before it stores them (MappedField._make_room), never here.
        prot = _syscalls.PROT_READ | (_syscalls.PROT_WRITE if self.writable else 0)
        # The whole slot: past the chunk it maps past the file's end (never touched), which keeps
        # one mapping per chunk where an anonymous gap would add a second (vm.max_map_count).
        # (No MADV_HUGEPAGE: no gain for adds, and a fault on an uncached page then reads 2-4 MiB
        # whatever the readahead settings; see scripts/bench_images.py FINDINGS.)
        flags = _syscalls.MAP_SHARED | _syscalls.MAP_FIXED
        addr = _syscalls.libc.mmap(self.base + k * self.stride, self.stride, prot, flags, fd, 0)
        if addr is None or addr == _syscalls.MAP_FAILED:
            _syscalls.check_address(addr, f"map {_named(name)}")
        self.mapped[k] = True

    def unmap_chunk(self, k: int) -> None:
        """Put zero pages back at chunk ``k``."""
        self._check_open()
        flags = _syscalls.MAP_PRIVATE | _syscalls.MAP_ANON | _syscalls.MAP_NORESERVE | _syscalls.MAP_FIXED
        addr = _syscalls.libc.mmap(self.base + k * self.stride, self.stride, _syscalls.PROT_READ, flags, -1, 0)
        _syscalls.check_address(addr, "unmap chunk")
        self.mapped[k] = False

    def sync(self, k: int) -> None:
        """``msync`` chunk ``k`` to disk (durability against power loss); a write-back error
        (``EIO``...) is raised, not ignored, so ``flush(fsync=True)`` never commits rows that
        did not reach the disk."""
        if _syscalls.libc.msync(self.base + k * self.stride, self.chunk_bytes, 4) != 0:  # MS_SYNC
            err = ctypes.get_errno()
            raise OSError(err, f"msync of chunk {k}: {os.strerror(err)}")

    def _check_open(self) -> None:
        """Refuse a ``MAP_FIXED`` call once the range is unmapped: with ``base`` 0 it would map
        over whatever the process has at that low address."""
        if not self.base:
            raise ClosedError("the field's mapping was closed (its store was closed)")

    def close(self) -> None:
        """Unmap the whole range (idempotent): arrays viewing it must not be touched afterwards."""
        if self.base:
            _syscalls.libc.munmap(self._reserved_at, self._reserved)
            self.base = 0
            self.array = self.chunks = self._bytes = self._rows_at = None  # type: ignore[assignment]

    def __del__(self) -> None:
        if _collecting[0] and self.base:
            _finalized.append(self)  # unmapped when the collection is over (see _after_collection)
            return
        try:
            self.close()
        except Exception:
            pass


# The cyclic collector finalizes a cycle's objects in no particular order.  A buffer dropped
# without close() sits in a cycle with its store, tables and fields, and its __del__ closes it:
# the staged rows are written through these mappings and committed.  Were an array of that cycle
# unmapped by its own __del__ first, those rows would be lost.  So an array finalized while the
# collector runs stays mapped until the collection is over, and is unmapped then unless something
# still holds it (a buffer kept for a later commit, base.py's _DEFERRED): that one is unmapped by
# its owner's close, or at a later collection.
_collecting = [False]
_finalized: list[VirtualArray] = []


def _after_collection(phase: str, info: dict[str, Any]) -> None:
    _collecting[0] = phase == "start"
    if phase != "stop" or not _finalized:
        return
    pending, _finalized[:] = list(_finalized), []
    for va in pending:
        # Held by `pending`, `va` and getrefcount's argument only: nothing else can reach it.
        if va.base and sys.getrefcount(va) > 3:
            _finalized.append(va)
        else:
            va.close()
    del pending


gc.callbacks.append(_after_collection)
