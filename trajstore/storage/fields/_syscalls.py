"""What the Linux kernel offers the memory-mapped engine, bound through ctypes.

This is the system layer under :class:`trajstore.storage.fields._vmap.VirtualArray`: libc's
``mmap``, ``munmap``, ``msync``, ``madvise``, ``mincore`` and ``fallocate``, the Linux flag
values they take, the page and huge-page sizes, whether this process can map chunk files at all
(:data:`AVAILABLE`), whether a store's filesystem can (:func:`mapping_works`), whether the kernel
knows ``MADV_POPULATE_WRITE`` (:func:`populate_write_works`), and block preallocation
(:func:`reserve`).  It exists apart from the array so that the array's code is only about its
layout and views, and the one place that knows about libc and kernel flags is this one.

:data:`AVAILABLE` says whether this process can build a mapped array (Linux with a loadable
libc, and the environment variable ``TRAJSTORE_NO_MMAP`` unset or ``0``); it is computed at
import and never raises.  Where it is False (macOS, Windows, a libc ctypes cannot load,
``TRAJSTORE_NO_MMAP=1``), or where the first mapping on a store fails (:func:`mapping_works`),
raw fields are read and written through zarr chunk by chunk instead
(:class:`trajstore.storage.fields.chunked.ChunkedField`): the same bytes on disk, slower random
reads.

A store through a shared mapping into a file page the filesystem cannot allocate (a hole
on a full disk) kills the process with ``SIGBUS``; ``write`` would have returned ``ENOSPC``.
So the writer maps only files whose blocks are allocated: :func:`reserve` allocates them
(``posix_fallocate``) before a file is mapped writable, and a full disk is an ``OSError``
there, at a point where nothing has been written yet.

Values rebound at run time must be read as attributes of this module (``_syscalls.AVAILABLE``),
never imported by name, because an imported copy keeps the value it had at import:
:data:`AVAILABLE`, ``SUPPORTED`` and :data:`UNAVAILABLE_REASON` (rebound by :func:`disable`),
:data:`POPULATE_WRITE` (by :func:`populate_write_works` and
:meth:`trajstore.storage.fields._vmap.VirtualArray.populate`), and
``libc``, :data:`HUGE` and ``MADV_POPULATE_WRITE``, which tests replace.
"""

from __future__ import annotations

import ctypes
import errno
import mmap as _mmap
import os
import sys
from typing import Any

PAGE = _mmap.PAGESIZE

#: Environment variable that turns the memory-mapped engine off (``1``): raw fields then go
#: through :class:`trajstore.storage.fields.chunked.ChunkedField`, as on systems without ``MAP_FIXED``.
NO_MMAP_ENV = "TRAJSTORE_NO_MMAP"

# Linux values (the flag bits differ on other systems, which take the portable path).
PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANON, MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_DONTNEED, MADV_POPULATE_WRITE = 4, 23

libc: Any = None
_fallocate: Any = None


def _load_libc() -> str | None:
    """Bind libc's mmap, munmap, msync and fallocate; the reason when that is not possible."""
    global libc, _fallocate
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
    libc = libc
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
MAP_UNSUPPORTED = {errno.EINVAL, errno.EPERM, errno.EACCES, errno.ENODEV, errno.ENOSYS,
                    getattr(errno, "ENOTSUP", errno.EOPNOTSUPP), errno.EOPNOTSUPP}


#: ``madvise(MADV_POPULATE_WRITE)`` works here (Linux 5.14 on); None: not tried yet
#: (:func:`populate_write_works`).  madvise answers that say it does not:
POPULATE_WRITE: bool | None = None if AVAILABLE else False
ADVICE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM}


def populate_write_works() -> bool:
    """Whether ``madvise(MADV_POPULATE_WRITE)`` works here, tried once on a page of anonymous
    memory (:data:`POPULATE_WRITE`)."""
    global POPULATE_WRITE
    if POPULATE_WRITE is None:
        page = libc.mmap(None, PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANON, -1, 0)
        if page is None or page == MAP_FAILED:
            return False  # (no memory now: ask again next time)
        try:
            POPULATE_WRITE = libc.madvise(page, PAGE, MADV_POPULATE_WRITE) == 0
        finally:
            libc.munmap(page, PAGE)
    return POPULATE_WRITE


def disable(reason: str) -> None:
    """Turn the mapped engine off for the rest of this process (a mapping failed: see
    :func:`mapping_works`); fields opened afterwards use the portable engine."""
    global AVAILABLE, SUPPORTED, UNAVAILABLE_REASON
    AVAILABLE = SUPPORTED = False
    UNAVAILABLE_REASON = reason


def mapping_works(fd: int) -> bool:
    """Whether a file of this filesystem maps the way :class:`trajstore.storage.fields._vmap.VirtualArray`
    maps chunk files: one page of the open file ``fd`` (read-only, any non-empty regular file)
    ``MAP_SHARED | MAP_FIXED`` into a reserved range, then both unmapped.  Nothing is read or written.

    Returns False when ``mmap`` answers with an error that says the filesystem cannot do it (the
    caller uses the portable engine for that store), and turns the engine off for the whole
    process (:func:`disable`) when not even address space can be reserved; other errors (no
    memory...) are raised.
    """
    if not AVAILABLE:
        return False
    base = libc.mmap(None, PAGE, PROT_READ, MAP_PRIVATE | MAP_ANON | MAP_NORESERVE, -1, 0)
    if base is None or base == MAP_FAILED:
        err = ctypes.get_errno()
        if err in MAP_UNSUPPORTED:
            disable(f"reserving address space failed ({os.strerror(err)})")
            return False
        raise OSError(err, f"reserve address range: {os.strerror(err)}")
    try:
        addr = libc.mmap(base, PAGE, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0)
        if addr is None or addr == MAP_FAILED:
            err = ctypes.get_errno()
            if err in MAP_UNSUPPORTED:
                return False
            raise OSError(err, f"map a file: {os.strerror(err)}")
        return True
    finally:
        libc.munmap(base, PAGE)


# Answers of posix_fallocate / fallocate for "this filesystem cannot preallocate" (glibc's
# posix_fallocate emulates it by writing a byte per block where the kernel lacks fallocate;
# musl and some FUSE/network filesystems answer with one of these instead).
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS}


def _fallocate_in_place(fd: int, nbytes: int, offset: int = 0) -> None:
    """The ``fallocate(2)`` system call itself, mode 0, on bytes ``[offset, offset + nbytes)``:
    allocates holes, never writes content (unlike glibc's posix_fallocate fallback, which writes
    a zero byte into every block that reads as zero: a race with another process writing that
    block), and grows the file only where the range ends past it."""
    if _fallocate is None:
        raise OSError(errno.ENOSYS, "fallocate is not available")
    if _fallocate(fd, 0, offset, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def reserve_range(fd: int, offset: int, nbytes: int) -> bool:
    """Allocate bytes ``[offset, offset + nbytes)`` of the file ``fd`` in place (its size and
    content unchanged where it is already that long), so stores through a mapping of them cannot
    meet a full disk.

    Returns False where the filesystem cannot preallocate (nothing done: the caller decides);
    raises ``OSError`` (``ENOSPC`` on a full disk) having changed no byte of content.
    """
    try:
        # The system call itself, never glibc's posix_fallocate: its emulation (a filesystem without
        # fallocate) writes a zero byte into blocks that read as zero, which races with another
        # process storing rows there (multiprocessing writers share chunk files).
        _fallocate_in_place(fd, nbytes, offset)
    except OSError as e:
        if e.errno in _UNSUPPORTED:
            return False
        raise
    return True


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Give back the disk blocks of bytes ``[offset, offset + nbytes)`` of the file ``fd``, which
    must read as zeros already: the content and size are unchanged whether or not this reaches the
    disk before a crash.  False where the filesystem cannot (nothing done)."""
    if _fallocate is None or nbytes <= 0:
        return False
    return bool(_fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0)


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


def check_address(addr: int | None, what: str) -> int:
    """``addr`` returned by mmap; None or ``MAP_FAILED`` raises OSError from errno, naming ``what``."""
    if addr is None or addr == MAP_FAILED:
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
