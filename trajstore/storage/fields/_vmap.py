"""One numpy view over many chunk files mapped into one reserved address range (Linux).

:data:`AVAILABLE` says whether this process can build one (Linux with a loadable libc, and the
environment variable ``TRAJSTORE_NO_MMAP`` unset or ``0``); it is computed at import and never
raises.  Where it is False (macOS, Windows, a libc ctypes cannot load, ``TRAJSTORE_NO_MMAP=1``),
or where the first mapping on a store fails (:func:`mapping_works`), raw fields are read and
written through zarr chunk by chunk instead (:class:`trajstore.storage.fields.chunked.ChunkedField`): the same
bytes on disk, slower random reads.

An uncompressed zarr chunk file is a raw C-order block of ``chunk_rows`` rows.  We
reserve one virtual address range for the whole field and map each chunk file at its
slot with ``MAP_FIXED``; unmapped slots are anonymous zero pages (what zarr reads
for a missing chunk).  A random gather is then a single numpy fancy index over the
page cache, which is what a plain ``np.memmap`` of one big file costs.  Chunk byte
sizes must be multiples of the page size.  Chunks smaller than a huge page tile the range
end to end (one contiguous array); larger ones start on huge-page boundaries
(:func:`slot_bytes`), so the kernel maps their 2 MiB page-cache folios in one fault each.

A store through a shared mapping into a file page the filesystem cannot allocate (a hole
on a full disk) kills the process with ``SIGBUS``; ``write`` would have returned ``ENOSPC``.
So the writer maps only files whose blocks are allocated: :func:`reserve` allocates them
(``posix_fallocate``) before a file is mapped writable, and a full disk is an ``OSError``
there, at a point where nothing has been written yet.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap as _mmap
import os
import stat
import sys
from typing import Any, Callable

import numpy as np

from trajstore.errors import ClosedError

PAGE = _mmap.PAGESIZE

#: Environment variable that turns the memory-mapped engine off (``1``): raw fields then go
#: through :class:`trajstore.storage.fields.chunked.ChunkedField`, as on systems without ``MAP_FIXED``.
NO_MMAP_ENV = "TRAJSTORE_NO_MMAP"

# Linux values (the flag bits differ on other systems, which take the portable path).
_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANON, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_DONTNEED, _MADV_POPULATE_WRITE = 4, 23

_libc: Any = None
_fallocate: Any = None


def _load_libc() -> str | None:
    """Bind libc's mmap, munmap, msync and fallocate; the reason when that is not possible."""
    global _libc, _fallocate
    if not sys.platform.startswith("linux"):
        return f"{sys.platform} is not Linux"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.msync.restype = ctypes.c_int
        libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError) as e:  # no loadable libc (static builds, some sandboxes)
        return f"libc cannot be loaded ({e})"
    _libc = libc
    fa = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if fa is not None:
        fa.restype = ctypes.c_int
        fa.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate = fa
    return None


def _disabled_by_env() -> bool:
    return os.environ.get(NO_MMAP_ENV, "").strip().lower() not in ("", "0", "false", "no")


#: Why the mapped engine is off in this process (None: it is on).
UNAVAILABLE_REASON: str | None = _load_libc()
if UNAVAILABLE_REASON is None and _disabled_by_env():
    UNAVAILABLE_REASON = f"{NO_MMAP_ENV} is set"
#: The memory-mapped engine can be used in this process (see the module docstring).
AVAILABLE: bool = UNAVAILABLE_REASON is None
#: Former name of :data:`AVAILABLE`.
SUPPORTED = AVAILABLE

# Errors of a first mmap that mean "this system or filesystem cannot map files this way" (not a
# full disk or a damaged file): the caller falls back on the portable engine.
_MAP_UNSUPPORTED = {errno.EINVAL, errno.EPERM, errno.EACCES, errno.ENODEV, errno.ENOSYS,
                    getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EOPNOTSUPP}


#: ``madvise(MADV_POPULATE_WRITE)`` works here (Linux 5.14 on); None: not tried yet
#: (:func:`populate_write_works`).  madvise answers that say it does not:
POPULATE_WRITE: bool | None = None if AVAILABLE else False
_ADVICE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


def populate_write_works() -> bool:
    """Whether ``madvise(MADV_POPULATE_WRITE)`` works here, tried once on a page of anonymous
    memory (:data:`POPULATE_WRITE`)."""
    global POPULATE_WRITE
    if POPULATE_WRITE is None:
        page = _libc.mmap(None, PAGE, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANON, -1, 0)
        if page is None or page == _MAP_FAILED:
            return False  # (no memory now: ask again next time)
        try:
            POPULATE_WRITE = _libc.madvise(page, PAGE, _MADV_POPULATE_WRITE) == 0
        finally:
            _libc.munmap(page, PAGE)
    return POPULATE_WRITE


def disable(reason: str) -> None:
    """Turn the mapped engine off for the rest of this process (a mapping failed: see
    :func:`mapping_works`); fields opened afterwards use the portable engine."""
    global AVAILABLE, SUPPORTED, UNAVAILABLE_REASON
    AVAILABLE = SUPPORTED = False
    UNAVAILABLE_REASON = reason


def mapping_works(fd: int) -> bool:
    """Whether a file of this filesystem maps the way :class:`VirtualArray` maps chunk files: one
    page of the open file ``fd`` (read-only, any non-empty regular file) ``MAP_SHARED | MAP_FIXED``
    into a reserved range, then both unmapped.  Nothing is read or written.

    Returns False when ``mmap`` answers with an error that says the filesystem cannot do it (the
    caller uses the portable engine for that store), and turns the engine off for the whole
    process (:func:`disable`) when not even address space can be reserved; other errors (no
    memory...) are raised.
    """
    if not AVAILABLE:
        return False
    base = _libc.mmap(None, PAGE, _PROT_READ, _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE, -1, 0)
    if base is None or base == _MAP_FAILED:
        err = ctypes.get_errno()
        if err in _MAP_UNSUPPORTED:
            disable(f"reserving address space failed ({os.strerror(err)})")
            return False
        raise OSError(err, f"reserve address range: {os.strerror(err)}")
    try:
        addr = _libc.mmap(base, PAGE, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            if err in _MAP_UNSUPPORTED:
                return False
            raise OSError(err, f"map a file: {os.strerror(err)}")
        return True
    finally:
        _libc.munmap(base, PAGE)


# Answers of posix_fallocate / fallocate for "this filesystem cannot preallocate" (glibc's
# posix_fallocate emulates it by writing a byte per block where the kernel lacks fallocate;
# musl and some FUSE/network filesystems answer with one of these instead).
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


def _fallocate_in_place(fd: int, nbytes: int) -> None:
    """The ``fallocate(2)`` system call itself, mode 0: allocates holes, never writes content
    (unlike glibc's posix_fallocate fallback, which writes a zero byte into every block that
    reads as zero: a race with another process writing that block)."""
    if _fallocate is None:
        raise OSError(errno.ENOSYS, "fallocate is not available")
    if _fallocate(fd, 0, 0, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def reserve(fd: int, nbytes: int, *, fresh: bool) -> None:
    """Make the filesystem allocate bytes ``[0, nbytes)`` of the file ``fd`` (growing it to
    ``nbytes`` if shorter), so later stores through a mapping of them cannot fail.

    Raises ``OSError`` (``ENOSPC`` on a full disk) without having changed any byte of content.
    Where the filesystem cannot preallocate: a ``fresh`` file (all zeros, not yet visible to
    anyone) is filled with written zeros instead, which allocates it just as well; an existing
    file is left as it is, because writing zeros into it could overwrite rows another process
    wrote meanwhile (a known, documented gap: such filesystems keep the SIGBUS risk for chunk
    files created sparse by earlier trajstore versions, and only for those).
    """
    try:
        if fresh:
            if not hasattr(os, "posix_fallocate"):  # macOS, Windows: zeros are written below
                raise OSError(errno.ENOSYS, "posix_fallocate is not available")
            os.posix_fallocate(fd, 0, nbytes)
        else:
            _fallocate_in_place(fd, nbytes)
        return
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    if not fresh:
        return
    zeros = memoryview(bytes(min(nbytes, 1 << 20)))
    pos = 0
    while pos < nbytes:
        pos += os.pwrite(fd, zeros[: min(len(zeros), nbytes - pos)], pos)


def allocated_bytes(st: os.stat_result) -> int:
    """Bytes of a file the filesystem has blocks for (less than its size when it has holes)."""
    return st.st_blocks * 512


def _named(name: str | Callable[[], str]) -> str:
    """A file's name for an error of :meth:`VirtualArray.map_chunk`, given or built now."""
    return name if isinstance(name, str) else name()


def _check(addr: int | None, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return addr


def _huge_page_bytes() -> int:
    """Bytes one page-table entry maps at the level above pages (2 MiB on x86-64 and arm64 with
    4 KiB pages): the span a page-cache folio of that size is mapped with in one fault."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            n = int(f.read().strip())
    except (OSError, ValueError):
        n = 2 << 20
    return n if n > PAGE and n % PAGE == 0 and n & (n - 1) == 0 else 2 << 20


#: See :func:`_huge_page_bytes`.
HUGE = _huge_page_bytes()
#: ``VirtualArray.resident`` probes one page per this many bytes.
PROBE_BYTES = 1 << 20


def slot_bytes(chunk_bytes: int) -> int:
    """Address space given to one chunk: the chunk itself, rounded up to :data:`HUGE` when it
    spans at least one.

    Why: the kernel maps a page-cache folio of :data:`HUGE` bytes (a file read or written in large
    blocks gets them) with one page-table entry, on one fault, but only where the virtual address
    and the file offset agree modulo :data:`HUGE`.  Chunks laid end to end start at multiples of
    their own size, which for image rows (28,224 bytes for (84,84,4) uint8) never is a multiple of
    2 MiB; such chunks were mapped 64 KiB per fault (fault-around), and the first few hundred
    batches of a freshly opened store took 300 faults each where a plain ``np.memmap`` took 70.
    """
    return -(-chunk_bytes // HUGE) * HUGE if chunk_bytes >= HUGE else chunk_bytes


class VirtualArray:
    """A reserved address range holding ``n_chunks`` chunks of ``chunk_rows`` rows, each chunk
    file mapped at its slot.

    Slots are :func:`slot_bytes` apart.  Where that equals a chunk's size the rows are one
    contiguous array (:attr:`array`); otherwise every chunk starts on a :data:`HUGE` boundary and
    :attr:`chunks` is the only view (``array`` is None).  Use :meth:`take`, :meth:`windows`,
    :meth:`rows` and :meth:`put`, which serve both.

    Parameters
    ----------
    n_chunks : int
        Number of chunk slots to reserve.
    chunk_rows : int
        Rows per chunk; ``chunk_rows * row_bytes`` must be a multiple of :data:`PAGE`.
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
        if self.chunk_bytes % PAGE:
            raise ValueError(f"chunk of {self.chunk_bytes} bytes is not a multiple of the page size {PAGE}")
        self.n_chunks = max(int(n_chunks), 1)
        self.stride = slot_bytes(self.chunk_bytes)
        self.nbytes = self.n_chunks * self.stride
        # Reserve one HUGE more than needed, so the range can start on a HUGE boundary.
        align = HUGE if self.chunk_bytes >= HUGE else PAGE
        self._reserved = self.nbytes + align - PAGE
        flags = _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE
        self._reserved_at = _check(_libc.mmap(None, self._reserved, _PROT_READ, flags, -1, 0), "reserve address range")
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

    def take(self, phys: np.ndarray) -> np.ndarray:
        """Copies of rows ``phys`` (B,) int64: (B, *row_shape)."""
        if self.array is not None:
            return self.array[phys]
        k, r = np.divmod(phys, self.chunk_rows)
        return self.chunks[k, r]

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
        return self._address(lo) & ~(PAGE - 1), -(-(self._address(hi - 1) + self.row_bytes) // PAGE) * PAGE

    def resident(self, lo: int, hi: int) -> bool:
        """The pages of rows ``[lo, hi)`` (one chunk, mapped) are in the page cache, judged by
        ``mincore`` of one page per :data:`PROBE_BYTES` and the last: a store into a page that is
        not reads it from disk first, where ``pwrite`` of whole pages reads nothing.  (Pages leave
        the page cache in folios and regions; every page's lookup cost 0.13-0.25 ms a block.)"""
        start, end = self._page_range(lo, hi)
        vec, out = self._probe_vec, self._probe_at
        last = end - PAGE
        for at in (*range(start, last, PROBE_BYTES), last):
            if _libc.mincore(at, PAGE, out) != 0 or not vec[0] & 1:
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
        global POPULATE_WRITE
        if not populate_write_works():
            return False
        start, end = self._page_range(lo, hi)
        if self.stride % HUGE == 0:
            _libc.madvise(start, end - start, _MADV_DONTNEED)
        while _libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in _ADVICE_UNSUPPORTED:
                POPULATE_WRITE = False
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
            Space for a sparse file could not be reserved, or ``mmap`` failed.
        """
        self._check_open()
        if st is None:
            st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise EOFError(f"chunk file {_named(name)!r} is not a regular file; not mapped")
        if st.st_size < self.chunk_bytes:
            raise EOFError(f"chunk file {_named(name)!r} holds {st.st_size} bytes; expected {self.chunk_bytes}")
        if self.writable and allocated_bytes(st) < self.chunk_bytes:
            # A file with holes (created sparse by an older trajstore): a store into a hole on
            # a full disk would SIGBUS, so allocate it first (content unchanged).  Files this
            # version creates are allocated whole, so this costs one fstat per mapped chunk.
            try:
                reserve(fd, self.chunk_bytes, fresh=False)
            except OSError as e:
                raise OSError(e.errno, f"reserve space for chunk file: {os.strerror(e.errno or 0)}", _named(name)) from None
        prot = _PROT_READ | (_PROT_WRITE if self.writable else 0)
        # The whole slot: past the chunk it maps past the file's end (never touched), which keeps
        # one mapping per chunk where an anonymous gap would add a second (vm.max_map_count).
        # (No MADV_HUGEPAGE: no gain for adds, and a fault on an uncached page then reads 2-4 MiB
        # whatever the readahead settings; see scripts/bench_images.py FINDINGS.)
        addr = _libc.mmap(self.base + k * self.stride, self.stride, prot, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            _check(addr, f"map {_named(name)}")
        self.mapped[k] = True

    def unmap_chunk(self, k: int) -> None:
        """Put zero pages back at chunk ``k``."""
        self._check_open()
        flags = _MAP_PRIVATE | _MAP_ANON | _MAP_NORESERVE | _MAP_FIXED
        _check(_libc.mmap(self.base + k * self.stride, self.stride, _PROT_READ, flags, -1, 0), "unmap chunk")
        self.mapped[k] = False

    def sync(self, k: int) -> None:
        """``msync`` chunk ``k`` to disk (durability against power loss); a write-back error
        (``EIO``...) is raised, not ignored, so ``flush(fsync=True)`` never commits rows that
        did not reach the disk."""
        if _libc.msync(self.base + k * self.stride, self.chunk_bytes, 4) != 0:  # MS_SYNC
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
            _libc.munmap(self._reserved_at, self._reserved)
            self.base = 0
            self.array = self.chunks = self._bytes = None  # type: ignore[assignment]

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
