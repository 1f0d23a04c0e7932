"""The writer lock of a local store: one single writer, or many multiprocessing writers.

Advisory locks on ``trajstore.lock`` (:data:`~trajstore.storage.keys.LOCK_KEY`): ``flock`` on
Linux and macOS, ``msvcrt.locking`` byte-range locks on Windows (:func:`lock_backend`).  The lock
file's text records whether the last single writer closed cleanly ("open pid=..." / "closed"),
so the next writer knows to clean up after a crash.

Remote (fsspec) stores cannot be ``flock``-ed: a writer there holds a :class:`RemoteLease`, an
object ``trajstore.lease.json`` created with exclusive-create semantics (:func:`exclusive_put`:
``If-None-Match: *`` on S3, an exclusive create on ``memory://``), and checks before every commit
that the commit record on the store is still the one it last wrote (:meth:`RemoteLease.check`),
so a second writer is refused at open and a commit never silently replaces another writer's
(docs/scale.md lists the guarantee per backend).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
import uuid
import weakref
from typing import Any, Protocol

from zarr.core.sync import sync

from trajstore.errors import BadOptionError, DamagedStoreError, LockedError
from trajstore.storage.confined import OPEN_FLAGS, full_disk, pread, pwrite
from trajstore.storage.head import read_head, sync_prev
from trajstore.storage.keys import LOCK_KEY, MPLOCK_KEY
from trajstore.storage.location import Location

__all__ = ["FlockBackend", "LEASE_KEY", "LockBackend", "MsvcrtBackend", "RemoteLease", "WriterLock", "exclusive_put",
           "exclusive_create_supported", "lock_backend", "needs_lease"]


class LockBackend(Protocol):
    """Advisory locks on an open lock file: what :class:`WriterLock` needs from the system.

    Every lock belongs to the descriptor and goes away when it is closed or its process dies
    (a killed writer never leaves a store locked).  Only writers lock; readers never do.
    """

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


class MsvcrtBackend:
    """``msvcrt.locking`` (Windows): exclusive byte-range locks only, so a shared lock is built
    from them.

    The locked bytes lie far past the lock file's text (Windows byte-range locks are mandatory:
    a locked byte cannot be read by others, and the text must stay readable).  An exclusive
    holder locks the gate byte and every one of :attr:`SLOTS` slot bytes; a shared holder locks
    one slot byte, choosing it while it briefly holds the gate.  So a single writer excludes
    everyone, multiprocessing writers exclude only a single writer, and at most :attr:`SLOTS`
    processes share a store.  The system drops a process's locks when it exits.
    """

    GATE = 1 << 30
    SLOTS = 256
    #: How long a shared locker retries a gate that another shared locker holds for an instant.
    GATE_WAIT_S = 0.25

    def __init__(self, msvcrt_module: Any) -> None:
        self.m = msvcrt_module
        self._held: dict[int, int] = {}  # fd -> slot of a shared lock (-1: exclusive)

    def _lock(self, fd: int, offset: int, n: int) -> bool:
        os.lseek(fd, offset, os.SEEK_SET)
        try:
            self.m.locking(fd, self.m.LK_NBLCK, n)
            return True
        except OSError:
            return False

    def _unlock(self, fd: int, offset: int, n: int) -> None:
        os.lseek(fd, offset, os.SEEK_SET)
        self.m.locking(fd, self.m.LK_UNLCK, n)

    def try_exclusive(self, fd: int) -> bool:
        if not self._lock(fd, self.GATE, 1):
            return False
        if not self._lock(fd, self.GATE + 1, self.SLOTS):  # multiprocessing writers hold slots
            self._unlock(fd, self.GATE, 1)
            return False
        self._held[fd] = -1
        return True

    def try_shared(self, fd: int) -> bool:
        deadline = time.monotonic() + self.GATE_WAIT_S
        while not self._lock(fd, self.GATE, 1):
            if time.monotonic() > deadline:  # held for good: a single writer
                return False
            time.sleep(0.002)
        try:
            for i in range(self.SLOTS):
                if self._lock(fd, self.GATE + 1 + i, 1):
                    self._held[fd] = i
                    return True
            return False  # every slot taken: as many writers as the lock admits
        finally:
            self._unlock(fd, self.GATE, 1)

    def downgrade(self, fd: int) -> None:
        if self._held.get(fd) != -1:
            return
        # Still holding the gate, so no one can take a slot meanwhile: slot 0 is free.
        self._unlock(fd, self.GATE + 1, self.SLOTS)
        if not self._lock(fd, self.GATE + 1, 1):
            raise LockedError("the writer lock could not be shared (slot 0 taken)")
        self._held[fd] = 0
        self._unlock(fd, self.GATE, 1)

    def acquire(self, fd: int) -> None:
        pause = 0.0005
        while not self._lock(fd, self.GATE, 1):
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def release(self, fd: int) -> None:
        self._unlock(fd, self.GATE, 1)

    def forget(self, fd: int) -> None:
        self._held.pop(fd, None)


class _NoLockBackend:
    """Neither ``fcntl`` nor ``msvcrt``: local stores cannot be opened for writing (reading works)."""

    def _refuse(self, fd: int) -> bool:
        raise LockedError("this system has neither fcntl nor msvcrt locks: local stores can only be opened "
                          "read_only=True here")

    try_exclusive = try_shared = _refuse

    def downgrade(self, fd: int) -> None:
        pass

    acquire = release = forget = downgrade


def lock_backend() -> LockBackend:
    """The lock of this system: ``fcntl.flock`` where ``fcntl`` imports, else ``msvcrt.locking``.

    Imported here, not at the top of the module: Windows has no ``fcntl`` (``import trajstore``
    must work there), POSIX systems no ``msvcrt``.
    """
    try:
        import fcntl
    except ImportError:
        pass
    else:
        return FlockBackend(fcntl)
    try:
        import msvcrt
    except ImportError:
        return _NoLockBackend()
    return MsvcrtBackend(msvcrt)


_BACKEND: LockBackend | None = None


def _locks() -> LockBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = lock_backend()
    return _BACKEND


class WriterLock:
    """A lock on ``<store>/trajstore.lock`` (``flock``, or ``msvcrt`` byte-range locks on
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
        path = loc.local_root / LOCK_KEY
        fd = _open_lock_file(path)
        try:
            if locks.try_exclusive(fd):
                self._exclusive = True
            elif not shared:
                holder = pread(fd, 200, 0).decode(errors="replace").strip()
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


# ------------------------------------------------------------------------------------------------
# remote stores: exclusive create, the writer's lease, the generation check before a commit
# ------------------------------------------------------------------------------------------------

#: The lease object of a remote store's writer (JSON: owner token, host, pid, last renewal).
LEASE_KEY = "trajstore.lease.json"
#: A lease not renewed for this long belongs to a writer that is gone (another host's crash).
LEASE_TTL_S = 600.0
#: Bound on the lease object read back (it is input like every file of a store).
_MAX_LEASE_BYTES = 4096
#: fsspec protocols whose ``pipe_file(..., mode="create")`` is an atomic exclusive create
#: (s3fs sends ``If-None-Match: *``; the memory filesystem opens with ``"xb"``).  Others are
#: written after an existence check: a race of two writers opening at the same instant is then
#: caught only by the generation check of the first commit.
_EXCLUSIVE_PROTOCOLS = frozenset({"memory", "s3", "s3a"})


def _protocols(loc: Location) -> set[str]:
    proto = getattr(getattr(loc.zstore, "fs", None), "protocol", ())
    return {proto} if isinstance(proto, str) else set(proto)


def needs_lease(loc: Location) -> bool:
    """Whether a writer of ``loc`` takes a :class:`RemoteLease`: an fsspec store (a URL).  Local
    folders have the flock :class:`WriterLock`; in-memory stores and zips have one writer by
    construction."""
    return loc.local_root is None and loc.url is not None and hasattr(loc.zstore, "fs")


def exclusive_create_supported(loc: Location) -> bool:
    """Whether :func:`exclusive_put` is atomic on ``loc`` (local folders, ``memory://``, S3)."""
    return loc.local_root is not None or bool(_protocols(loc) & _EXCLUSIVE_PROTOCOLS)


def exclusive_put(loc: Location, key: str, data: bytes) -> bool:
    """Create ``key`` holding ``data`` unless something is stored there already.

    Local folders: the bytes go to a temp file that is hard-linked onto the key (``link`` fails
    when the name exists, and the key never holds partial bytes).  ``memory://`` and S3: one
    exclusive-create write (``If-None-Match: *``).  Other fsspec filesystems: an existence check,
    then a write (not atomic; see :func:`exclusive_create_supported`).

    Returns
    -------
    bool
        True when this call created the key, False when it existed.
    """
    if loc.local_root is not None:
        dest = loc.path(key)
        tmp = loc.new_tmp_path()
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            try:
                os.link(tmp, dest)
            except FileExistsError:
                return False
            return True
        finally:
            tmp.unlink(missing_ok=True)
    if exclusive_create_supported(loc):
        fs, full = loc.zstore.fs, f"{loc.zstore.path.rstrip('/')}/{key}"
        try:
            sync(fs._pipe_file(full, data, mode="create"))
        except FileExistsError:
            return False
        return True
    if loc.exists(key):
        return False
    loc.put(key, data)
    return True


class RemoteLease:
    """The writer lease of a remote store (see the module docstring).

    Taken at open by :meth:`acquire`; :meth:`check` runs before every commit record is written;
    :meth:`release` deletes the lease object when the writer closes.  A lease whose writer is
    gone is taken over: on the same host when its process no longer exists, from any host when
    it was not renewed for :data:`LEASE_TTL_S` seconds (a writer renews it at a commit once half
    of that has passed).
    """

    def __init__(self, loc: Location, record: dict[str, Any]) -> None:
        self.loc = loc
        self.record = record
        self.released = False

    @classmethod
    def acquire(cls, loc: Location, *, multiprocessing: bool = False) -> "RemoteLease":
        """Take the lease of ``loc`` (a writer opening or creating the store).

        Raises
        ------
        LockedError
            Another live writer holds it.
        BadOptionError
            ``multiprocessing=True``: a remote store has no inter-process lock; give every
            process a shard of its own (:func:`trajstore.shards.create_shard`).
        DamagedStoreError
            The lease object is not a lease (garbage, too large).
        """
        if multiprocessing:
            raise BadOptionError(f"{loc.url}: multiprocessing=True needs a local folder (its writers share a file "
                                 "lock); remote stores take one writer: give each process a shard of its own "
                                 "(trajstore.shards.create_shard)")
        record = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "renewed": time.time()}
        data = json.dumps(record).encode()
        for _ in range(3):
            if exclusive_put(loc, LEASE_KEY, data):
                return cls(loc, record)
            held = _read_lease(loc)
            if held is None:
                continue  # released meanwhile: try again
            if not _stale(held):
                raise LockedError(f"{loc.url}: another writer holds the store (lease {LEASE_KEY}: host "
                                  f"{held.get('host')!r}, pid {held.get('pid')!r}); open it with read_only=True, "
                                  "or write a shard of your own (trajstore.shards.create_shard)")
            loc.delete(LEASE_KEY)  # its writer is gone: take it over
        raise LockedError(f"{loc.url}: the writer lease {LEASE_KEY} kept changing hands while this writer opened")

    def check(self, generation: int) -> None:
        """Before a commit: the store's commit record must still be generation ``generation``
        (the one this writer last wrote or read); renew the lease when half its time has passed.

        Raises
        ------
        LockedError
            Another writer committed meanwhile (or took the lease over): this commit would replace
            its record and lose its rows.
        """
        loc = self.loc
        try:
            on_store = read_head(loc).generation
        except Exception:
            on_store = None
        if on_store != generation:
            raise LockedError(f"{loc.url}: another writer committed to this store (its commit record is generation "
                              f"{on_store}, this writer's last was {generation}); refusing to overwrite it. Reopen "
                              "the store, or write a shard of your own")
        if time.time() - float(self.record["renewed"]) > LEASE_TTL_S / 2:
            held = _read_lease(loc)
            if held is None or held.get("owner") != self.record["owner"]:
                raise LockedError(f"{loc.url}: this writer's lease {LEASE_KEY} was taken over by another writer "
                                  f"({None if held is None else held.get('host')!r}); refusing to commit")
            self.record = dict(self.record, renewed=time.time())
            loc.put(LEASE_KEY, json.dumps(self.record).encode())

    def release(self) -> None:
        """Delete the lease object if it is still this writer's (idempotent; errors ignored: a
        lease left behind is taken over once stale)."""
        if self.released or self.record["pid"] != os.getpid():
            return  # a forked child's copy: the lease is its parent's
        self.released = True
        try:
            held = _read_lease(self.loc)
            if held is not None and held.get("owner") == self.record["owner"]:
                self.loc.delete(LEASE_KEY)
        except Exception:
            pass


def _read_lease(loc: Location) -> dict[str, Any] | None:
    raw = loc.get(LEASE_KEY, limit=_MAX_LEASE_BYTES)
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except ValueError:
        obj = None
    if not (isinstance(obj, dict) and isinstance(obj.get("owner"), str) and type(obj.get("pid")) is int
            and isinstance(obj.get("renewed"), (int, float)) and isinstance(obj.get("host"), str)):
        raise DamagedStoreError(f"{loc.url}: {LEASE_KEY} is not a writer lease (expected a JSON object with owner, "
                                "host, pid, renewed); if no writer is running, delete it")
    return obj


def _stale(held: dict[str, Any]) -> bool:
    """Whether the writer named by lease ``held`` is gone."""
    if time.time() - float(held["renewed"]) > LEASE_TTL_S:
        return True
    if held["host"] != socket.gethostname():
        return False
    pid = int(held["pid"])
    if pid == os.getpid():
        return False  # this very process holds it (another buffer on the same store)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # exists, owned by another user
    return False
