"""The writer lock of a local store: one single writer, or many multiprocessing writers.

Locks on ``trajstore.lock`` (:data:`~trajstore.storage.keys.LOCK_KEY`): ``flock`` on Linux and
macOS, :mod:`filelock`'s exclusive descriptor lock on Windows (:func:`lock_backend`; no
multiprocessing writers there).  The lock
file's text records whether the last single writer closed cleanly ("open pid=..." / "closed"),
so the next writer knows to clean up after a crash.  Remote stores cannot be locked this way:
their writers hold a lease (:mod:`trajstore.storage.lease`).
"""

from __future__ import annotations

import errno
import os
import stat
import weakref
from typing import Any, Protocol

from trajstore.errors import DamagedStoreError, LockedError
from trajstore.storage.confined import OPEN_FLAGS, full_disk, pread, pwrite
from trajstore.storage.head import sync_prev
from trajstore.storage.keys import LOCK_KEY, MPLOCK_KEY
from trajstore.storage.location import Location

__all__ = ["FilelockBackend", "FlockBackend", "LockBackend", "WriterLock", "lock_backend"]


class LockBackend(Protocol):
    """Advisory locks on an open lock file: what :class:`WriterLock` needs from the system.

    Every lock belongs to the descriptor and goes away when it is closed or its process dies
    (a killed writer never leaves a store locked).  Only writers lock; readers never do.
    """

    #: Whether :meth:`try_shared` and :meth:`downgrade` work (multiprocessing writers).
    shares: bool

    def try_exclusive(self, fd: int) -> bool:
        """Take the lock exclusively without waiting; False when anyone else holds it."""

    def try_shared(self, fd: int) -> bool:
        """Take the lock shared without waiting; False when it is held exclusively."""

    def downgrade(self, fd: int) -> None:
        """Turn an exclusive lock into a shared one."""

    def acquire(self, fd: int) -> None:
        """Take the lock exclusively, waiting as long as it takes (the op lock)."""

    def release(self, fd: int) -> None:
        """Drop what :meth:`acquire` took."""

    def forget(self, fd: int) -> None:
        """``fd`` is about to be closed (closing drops its locks)."""


class FlockBackend:
    """``fcntl.flock`` (Linux, macOS, BSDs): shared and exclusive locks of the open file description."""

    shares = True

    def __init__(self, fcntl_module: Any) -> None:
        self.f = fcntl_module

    def _try(self, fd: int, how: int) -> bool:
        try:
            self.f.flock(fd, how | self.f.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def try_exclusive(self, fd: int) -> bool:
        return self._try(fd, self.f.LOCK_EX)

    def try_shared(self, fd: int) -> bool:
        return self._try(fd, self.f.LOCK_SH)

    def downgrade(self, fd: int) -> None:
        self.f.flock(fd, self.f.LOCK_SH)

    def acquire(self, fd: int) -> None:
        self.f.flock(fd, self.f.LOCK_EX)

    def release(self, fd: int) -> None:
        self.f.flock(fd, self.f.LOCK_UN)

    def forget(self, fd: int) -> None:
        pass


class FilelockBackend:
    """:mod:`filelock`'s descriptor locks (systems without ``fcntl``: Windows): exclusive only.

    :func:`filelock.lock_descriptor` takes ``LockFileEx`` on the file's first byte on Windows
    (``flock`` elsewhere, which is how the tests run this backend on Linux); the system drops the
    lock when the descriptor is closed or its process dies, so a killed writer never leaves a
    store locked.  There is no shared lock, so :attr:`shares` is False: multiprocessing writers
    are refused where this is the system's lock (one writer per store, or shards).  Windows
    locks are mandatory: while a writer holds the lock file, other processes cannot read the text
    naming it (the refusal then says "unknown process").
    """

    shares = False

    def __init__(self, filelock_module: Any) -> None:
        self.fl = filelock_module

    def try_exclusive(self, fd: int) -> bool:
        return bool(self.fl.lock_descriptor(fd, blocking=False))

    def try_shared(self, fd: int) -> bool:
        raise LockedError("multiprocessing writers need shared file locks, which this system does not offer "
                          "(no fcntl: filelock's locks are exclusive); use one writer per store, or shards")

    def downgrade(self, fd: int) -> None:
        self.try_shared(fd)

    def acquire(self, fd: int) -> None:
        self.fl.lock_descriptor(fd, blocking=True, poll_interval=0.002)

    def release(self, fd: int) -> None:
        self.fl.unlock_descriptor(fd)

    def forget(self, fd: int) -> None:
        pass


class _NoLockBackend:
    """Neither ``fcntl`` nor :mod:`filelock`: local stores cannot be opened for writing (reading works)."""

    shares = False

    def _refuse(self, fd: int) -> bool:
        raise LockedError("this system has no fcntl and filelock is not installed (pip install filelock): local "
                          "stores can only be opened read_only=True here")

    try_exclusive = try_shared = _refuse

    def downgrade(self, fd: int) -> None:
        pass

    acquire = release = forget = downgrade


def lock_backend() -> LockBackend:
    """The lock of this system: ``fcntl.flock`` where ``fcntl`` imports, else :mod:`filelock`'s
    (Windows; a dependency there), else none (writing refused).

    Imported here, not at the top of the module: Windows has no ``fcntl`` (``import trajstore``
    must work there), and POSIX systems need no filelock.
    """
    try:
        import fcntl
    except ImportError:
        pass
    else:
        return FlockBackend(fcntl)
    try:
        import filelock
    except ImportError:
        return _NoLockBackend()
    return FilelockBackend(filelock)


_BACKEND: LockBackend | None = None


def _locks() -> LockBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = lock_backend()
    return _BACKEND


class WriterLock:
    """A lock on ``<store>/trajstore.lock`` (``flock``, or :mod:`filelock`'s exclusive lock on
    Windows: :func:`lock_backend`).

    A single writer holds it exclusively for its lifetime.  In ``multiprocessing`` mode each
    process holds it shared (so a single writer is still refused) and serializes every write
    operation with an exclusive ``flock`` on ``trajstore.mplock``, opened per process (a flock
    belongs to an open file, which ``fork`` would share).  ``sole`` says whether this writer was
    alone when it opened (so it may remove temp files); the lock file records whether the last
    single writer closed cleanly.  Remote stores have no lock.

    Fork: a flock belongs to the open file description, which a forked child shares.  So that
    a child (``os.fork``, multiprocessing's fork start method) does not keep the store locked
    after its parent closed, every live lock is told after a fork in the child
    (:func:`os.register_at_fork`): an exclusive lock closes the child's copy of the descriptor
    (the child is no writer: ``forked_child`` is set, and it must open the store again to
    write); a shared (multiprocessing) lock keeps it, since the child may write through the
    buffer it inherited, and drops only the op-lock descriptor (the child opens its own).
    """

    #: Bytes of the lock file's text ("open pid=..." / "closed"), padded with spaces and always
    #: written in place: rewriting allocated bytes needs no free space, so a writer still opens
    #: (and closes) on a full disk once the lock file exists.
    MARK_BYTES = 64

    def __init__(self, loc: Location, shared: bool) -> None:
        self.loc = loc
        self.shared = shared
        self._fd: int | None = None
        self._mp_fd: int | None = None
        self._pid = os.getpid()
        self._exclusive = False  # holds trajstore.lock exclusively (a single writer, or not yet shared)
        self.forked_child = False  # this process is a fork of the one that took the lock
        self.previous_unclean = False
        self.sole = loc.local_root is not None
        locks = self._locks = _locks()
        if loc.local_root is None:
            return
        if shared and not locks.shares:
            locks.try_shared(-1)  # raises: saying why multiprocessing writers cannot be here
        path = loc.local_root / LOCK_KEY
        fd = _open_lock_file(path)
        try:
            if locks.try_exclusive(fd):
                self._exclusive = True
            elif not shared:
                holder = _holder(fd)
                raise LockedError(
                    f"{loc.url}: another writer holds the store ({holder or 'unknown process'}); "
                    "open it with read_only=True, or use multiprocessing=True in every writer"
                ) from None
            else:
                self.sole = False
                if not locks.try_shared(fd):
                    raise LockedError(f"{loc.url}: a single (multiprocessing=False) writer holds the store") from None
        except BaseException:
            locks.forget(fd)
            os.close(fd)
            raise
        self._fd = fd
        self.previous_unclean = pread(fd, 200, 0).decode(errors="replace").startswith("open")
        if not shared:
            try:
                self._mark(f"open pid={os.getpid()}")
            except OSError as e:
                self._fd = None
                locks.forget(fd)
                os.close(fd)  # unlocks: nothing was written
                raise full_disk(e, path, "write the writer lock file") from None
        _LIVE_LOCKS.add(self)

    def _mark(self, text: str) -> None:
        """Record ``text`` in the lock file, in place (see :attr:`MARK_BYTES`)."""
        assert self._fd is not None
        data = text.encode()[: self.MARK_BYTES].ljust(self.MARK_BYTES)
        pwrite(self._fd, data, 0)
        if os.fstat(self._fd).st_size > self.MARK_BYTES:  # longer text of another version
            os.ftruncate(self._fd, self.MARK_BYTES)

    def share(self) -> None:
        """The writer has opened the store (every check passed, a pending rewrite rolled forward).

        A sole writer first makes the previous commit record equal to the head
        (:func:`sync_prev`), before it writes a row; then, in multiprocessing mode, it lets other
        writers in.
        """
        if self.sole and self._fd is not None and not self.forked_child:
            sync_prev(self.loc)
        if self.shared and self._fd is not None and self.sole:
            self._locks.downgrade(self._fd)
            self._exclusive = False

    def acquire_op(self) -> None:
        """Start one write operation (multiprocessing mode: wait for the other writers)."""
        if not self.shared or self.loc.local_root is None:
            return
        if self._mp_fd is None or self._pid != os.getpid():
            # First use, or a forked child: open our own file description.
            self._mp_fd = _open_lock_file(self.loc.local_root / MPLOCK_KEY)
            self._pid = os.getpid()
        self._locks.acquire(self._mp_fd)

    def release_op(self) -> None:
        """End the write operation :meth:`acquire_op` started (nothing when none was)."""
        if self._mp_fd is not None:
            self._locks.release(self._mp_fd)

    def _after_fork_in_child(self) -> None:
        """Runs in a freshly forked child (see the class docstring); never raises."""
        if self._mp_fd is not None:  # the parent's op-lock description: acquire_op opens our own
            self._locks.forget(self._mp_fd)
            _close_quietly(self._mp_fd)
            self._mp_fd = None
        if self._exclusive and self._fd is not None:
            self._locks.forget(self._fd)
            _close_quietly(self._fd)
            self._fd = None
            self.forked_child = True
            _LIVE_LOCKS.discard(self)

    def release(self) -> None:
        """Drop the lock (idempotent).  A single writer first marks the lock file ``closed``, so the
        next writer knows it ended cleanly; a forked child that inherited a multiprocessing lock
        leaves it to its parent."""
        _LIVE_LOCKS.discard(self)
        if self._pid != os.getpid() and not self.forked_child:
            return  # a forked multiprocessing child does not own the parent's lock
        if self._fd is not None:
            try:
                if not self.shared:
                    self._mark("closed")
            except OSError:
                pass  # left reading "open": the next writer cleans up as after a crash (safe)
            finally:
                self._locks.forget(self._fd)
                os.close(self._fd)
                self._fd = None
        if self._mp_fd is not None:
            self._locks.forget(self._mp_fd)
            os.close(self._mp_fd)
            self._mp_fd = None


def _open_lock_file(path: Any) -> int:
    """Open (create) a lock file of the store: only a regular file, never through a link or a FIFO
    (``O_CREAT`` on a link would create or truncate its target outside the store)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | OPEN_FLAGS, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DamagedStoreError(f"{os.fspath(path)}: the lock file is a symbolic link; remove it") from None
        if e.errno == errno.EISDIR:
            raise DamagedStoreError(f"{os.fspath(path)}: the lock file is a folder; remove it") from None
        raise full_disk(e, path, "create the writer lock file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DamagedStoreError(f"{os.fspath(path)}: the lock file is not a regular file; remove it")
    return fd


def _holder(fd: int) -> str:
    """The lock file's text naming its holder ("open pid=..."); empty where the system keeps
    others from reading a locked file (Windows' locks are mandatory)."""
    try:
        return pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# Live locks, so a forked child can drop what it must not hold (WriterLock._after_fork_in_child).
_LIVE_LOCKS: "weakref.WeakSet[WriterLock]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_LIVE_LOCKS):
        lock._after_fork_in_child()


if hasattr(os, "register_at_fork"):  # no fork on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)

