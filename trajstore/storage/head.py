"""The commit record (``trajstore.head.json``) and the writer lock.

The head is the only mutable metadata of a store: which rows of each table are
committed, the operation epoch, buffer-specific state (e.g. the current episode id) and,
while a rewrite is being moved into place, the list of staged chunks.  It is replaced
atomically (temp file + rename locally, a single PUT elsewhere) and written last, after
the data it names.

On a local folder the writer also keeps ``trajstore.head.prev.json`` (:data:`PREV_KEY`): right
after each record is renamed into place, the same bytes are written under that name (a copy, not
a hard link: damage in place must not reach both; one write into its single page, or temp file +
rename, so it is always whole).  So the
previous record is the current one, or (after a kill between the two renames) the one before
it; both name only rows that were committed.  Readers never use it; ``repair`` falls back on it
when the commit record itself is damaged (garbage bytes, wrong types, rows past the data).

The writer lock works on Linux and macOS (``flock``) and on Windows (``msvcrt.locking``
byte-range locks): see :class:`WriterLock` and :func:`lock_backend`.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import stat
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from trajstore.storage.confined import MAX_HEAD_BYTES, OPEN_FLAGS, full_disk, pread, pwrite
from trajstore.errors import DamagedStoreError, FormatVersionError, LockedError
from trajstore.storage.keys import FORMAT_VERSION, HEAD_KEY, LOCK_KEY, MPLOCK_KEY, PREV_KEY
from trajstore.storage.schema import check_int, load_json
from trajstore.storage.location import Location

__all__ = ["HEAD_KEY", "PREV_KEY", "LOCK_KEY", "MPLOCK_KEY", "FORMAT_VERSION", "TableState", "Head", "read_head",
           "write_head", "read_prev", "sync_prev", "WriterLock", "LockBackend", "FlockBackend", "MsvcrtBackend", "lock_backend"]



@dataclass
class TableState:
    """Committed rows ``[start, end)`` (absolute numbers) and the rows allocated in the arrays."""

    start: int = 0
    end: int = 0
    allocated: int = 0

    @property
    def count(self) -> int:
        return self.end - self.start


@dataclass
class Head:
    """One commit record.  ``generation`` grows with every commit; ``epoch`` grows whenever
    rows change identity or content in place (clear, set_at, remove_at), which tells
    readers that rows they already read may no longer be current."""

    generation: int = 0
    epoch: int = 0
    tables: dict[str, TableState] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, Any] | None = None

    def copy(self) -> "Head":
        # Field by field: a deepcopy per commit costs more than writing the record.
        tables = {k: TableState(t.start, t.end, t.allocated) for k, t in self.tables.items()}
        return Head(self.generation, self.epoch, tables, copy.deepcopy(self.state) if self.state else {},
                    copy.deepcopy(self.pending) if self.pending else None)

    def to_json(self) -> bytes:
        obj = {
            "format_version": FORMAT_VERSION,
            "generation": self.generation,
            "epoch": self.epoch,
            "tables": {k: {"start": t.start, "end": t.end, "allocated": t.allocated} for k, t in self.tables.items()},
            "state": self.state,
            "pending": self.pending,
        }
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str, *, check_rows: bool = True) -> "Head":
        """Parse and check a commit record (see :meth:`from_obj`); ``NaN``/``Infinity`` and nesting
        deeper than :data:`trajstore.storage.schema.MAX_DEPTH` are refused."""
        if len(raw) > MAX_HEAD_BYTES:
            raise DamagedStoreError(f"{where}: the commit record {HEAD_KEY} holds {len(raw)} bytes; at most "
                                    f"{MAX_HEAD_BYTES} are expected")
        return cls.from_obj(load_json(raw, where, HEAD_KEY, strict_numbers=True), where, check_rows=check_rows)

    @classmethod
    def from_obj(cls, obj: Any, where: str, *, check_rows: bool = True) -> "Head":
        """A :class:`Head` from a parsed commit record, every value checked for its type and range:
        integers in ``[0, 2**62)``, table entries as objects of ``start``/``end``/``allocated``,
        ``state`` an object (episode ids integers), ``pending`` null or an object (its content is
        checked against the schema by :func:`trajstore.storage.schema.check_pending`).  With ``check_rows``,
        also ``start <= end`` and ``end - start <= allocated`` (verify reports those itself).

        Raises
        ------
        DamagedStoreError
            Naming ``where``, the record and the offending value.
        FormatVersionError
            The record's ``format_version`` is newer than this trajstore reads.
        """
        w = f"{where}: {HEAD_KEY}"
        if not isinstance(obj, dict):
            what = {type(None): "null", list: "a list", str: "a string", bool: "a boolean"}.get(type(obj), "a number")
            raise DamagedStoreError(f"{w} is JSON {what}; expected an object")
        version = obj.get("format_version", FORMAT_VERSION)
        if type(version) is not int or version < 1:
            raise DamagedStoreError(f"{w}: format_version is {version!r}; expected an integer from 1")
        if version > FORMAT_VERSION:
            raise FormatVersionError(f"{w}: format version {version} is newer than this trajstore reads "
                                     f"({FORMAT_VERSION}); upgrade trajstore")
        for k in ("generation", "tables"):
            if k not in obj:
                raise DamagedStoreError(f"{w} has no {k!r}")
        generation = check_int(obj["generation"], "generation", w)
        epoch = check_int(obj.get("epoch", 0), "epoch", w)
        tables_j = obj["tables"]
        if not isinstance(tables_j, dict) or len(tables_j) > 16:
            raise DamagedStoreError(f"{w}: tables is {type(tables_j).__name__} of {len(tables_j) if isinstance(tables_j, (dict, list)) else 0}"
                                    " entries; expected an object naming each table")
        tables = {}
        for name, v in tables_j.items():
            if not isinstance(v, dict) or any(k not in v for k in ("start", "end", "allocated")):
                raise DamagedStoreError(f"{w}: table {name!r} is {v!r:.80}; expected an object with start, end, allocated")
            t = TableState(*(check_int(v[k], f"table {name!r} {k}", w) for k in ("start", "end", "allocated")))
            if check_rows and (t.start > t.end or t.end - t.start > t.allocated):
                raise DamagedStoreError(f"{where}: the commit record names impossible rows for {name!r}: {t} (expected "
                                        "start <= end and end - start <= allocated)")
            tables[name] = t
        state = obj.get("state")
        if state is None:
            state = {}
        if not isinstance(state, dict):
            raise DamagedStoreError(f"{w}: state is {state!r:.80}; expected an object")
        for k in ("current_episode_id", "next_episode_id"):
            if k in state:
                check_int(state[k], f"state {k}", w)
        pending = obj.get("pending")
        if pending is not None and not isinstance(pending, dict):
            raise DamagedStoreError(f"{w}: pending is {pending!r:.80}; expected null or an object")
        return cls(generation, epoch, tables, dict(state), pending or None)


def read_head(loc: Location) -> Head:
    """Read and validate the commit record of ``loc`` (a regular file of at most 1 MiB)."""
    raw = loc.get(HEAD_KEY, limit=MAX_HEAD_BYTES)
    if raw is None:
        raise DamagedStoreError(f"{loc.url}: the commit record {HEAD_KEY} is missing (or not a file)")
    return Head.from_json(raw, str(loc.url))


def write_head(loc: Location, head: Head, *, fsync: bool = False) -> None:
    """Replace the commit record by ``head`` (atomically), then, on a local folder, make
    :data:`PREV_KEY` the same record.

    The previous record is installed after the head, never before: at every instant the head is
    a whole record, and the previous one is a record that was committed (the current one, or the
    one before it while this function runs or after a kill inside it).  A failure to install it
    does not fail the commit, which is already in place: the stale copy is removed instead (so it
    can never name rows a later commit reused), and the next commit installs it again.
    """
    data = head.to_json()
    loc.put(HEAD_KEY, data, fsync=fsync)
    if loc.local_root is not None:
        _install_prev(loc, data, fsync)


#: Records up to this size replace the previous copy in place (one write into one page).
_PREV_IN_PLACE = 4096


def _install_prev(loc: Location, data: bytes, fsync: bool) -> None:
    """Make :data:`PREV_KEY` hold ``data``, the record just renamed into place (see :func:`write_head`).

    A file of its own, not a hard link to the record: a record damaged in place (a tool or an
    editor writing into it, a bad block) would damage both names of one file.  A record of at
    most one page replaces the copy in place (:func:`_write_prev_in_place`: no file is created,
    so a commit costs little more than before); a larger one, a missing copy and ``fsync``
    commits go through temp file + rename.
    """
    try:
        if fsync or len(data) > _PREV_IN_PLACE or not _write_prev_in_place(loc, data):
            loc.put(PREV_KEY, data, fsync=fsync)
    except Exception:
        try:  # an outdated copy must not outlive the commit that replaced it
            loc.delete(PREV_KEY)
        except Exception:
            pass


def _write_prev_in_place(loc: Location, data: bytes) -> bool:
    """Overwrite an existing copy of at most one page with ``data`` in a single ``write`` at offset 0,
    padded with spaces (JSON whitespace) to the file's size: the write lands in one page cache page
    at once, so a killed writer leaves the old or the new record, never a mix.  False when there
    is no such copy (missing, larger, a link or special file: the caller replaces it by rename).

    Raises
    ------
    OSError
        The write failed (the caller removes the copy).
    """
    try:
        fd = loc.open_inside(PREV_KEY, os.O_RDWR)
    except (FileNotFoundError, DamagedStoreError):
        return False
    try:
        size = os.fstat(fd).st_size
        if size > _PREV_IN_PLACE:
            return False
        buf = data + b" " * (size - len(data))
        if pwrite(fd, buf, 0) != len(buf):
            raise OSError(errno.EIO, "short write of the previous commit record")
        return True
    finally:
        os.close(fd)


def sync_prev(loc: Location) -> None:
    """Make :data:`PREV_KEY` the same record as the head, if it is not (a writer killed between
    the two renames of :func:`write_head` left the record before; a store written by an older
    trajstore has none).

    Called by the sole writer once it has opened the store, before it writes any row: a ring
    writer may reuse the slots of rows that the head no longer counts but the record before it
    did, so from then on the previous record must be the head.  A head that does not parse is
    left alone (``repair`` needs the previous record then); nothing is ever written through a
    link (both files are replaced by rename).
    """
    if loc.local_root is None or loc.read_only:
        return
    try:
        raw = loc.get(HEAD_KEY, limit=MAX_HEAD_BYTES)
        if raw is None:
            return
        Head.from_json(raw, str(loc.url))
    except (DamagedStoreError, FormatVersionError):
        return
    try:
        prev = loc.get(PREV_KEY, limit=MAX_HEAD_BYTES)
        if prev is not None and prev.rstrip(b" ") == raw:  # padded in place (_write_prev_in_place)
            return
    except DamagedStoreError:  # a link, FIFO or oversized file: replaced below
        pass
    _install_prev(loc, raw, False)


def read_prev(loc: Location) -> tuple[Head | None, str | None]:
    """The previous commit record ``(head, None)``, or ``(None, why)`` when there is none or it is
    unreadable.  Bounded like the record itself; only ``trajstore.errors`` problems are reported."""
    try:
        raw = loc.get(PREV_KEY, limit=MAX_HEAD_BYTES)
        if raw is None:
            return None, "there is no previous commit record"
        obj = load_json(raw, str(loc.url), PREV_KEY, strict_numbers=True)
        return Head.from_obj(obj, str(loc.url), check_rows=False), None
    except (DamagedStoreError, FormatVersionError) as e:
        msg = str(e).replace(HEAD_KEY, PREV_KEY)
        return None, msg.split(": ", 1)[1] if ": " in msg else msg


class HeadWatch:
    """Tells, for the cost of one ``stat``, whether the local commit record was replaced since
    this process last read or wrote it.

    A record is replaced by rename, so each one is a new file.  The watch keeps the file it
    last saw open: while it is open, its inode number cannot go to a later file, so comparing
    inode numbers is exact.  (Modification time and size are not: two commits within one clock
    tick, the second reusing the first one's freed inode, can leave all three equal.)

    Windows cannot rename onto a file another process holds open, so there the watch keeps no
    file open and compares (file id, modification time, size) instead: NTFS file ids are not
    reused as promptly as ext4 inodes, but this is a weaker check than on POSIX systems.
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._fd = -1
        self._ino: int | None = None  # None: nothing watched yet, so the record counts as changed
        # Called with every record read, before it is returned (the store's schema checks).
        self.check: Callable[[Head], None] | None = None

    def changed(self) -> bool:
        """Whether the record may differ from the one last read or written (always True for
        stores without a local head file)."""
        if self.loc.head_path is None or self._ino is None:
            return True
        try:
            return _identity(os.stat(self.loc.head_path)) != self._ino
        except FileNotFoundError:
            return True

    def read(self) -> Head:
        """Read the record and watch the file it came from (read through the same descriptor,
        so what was read and what is watched agree).

        ``check``, when set (the store sets it to its schema checks), is called with the parsed
        record before it is returned or watched.
        """
        check = self.check
        if self.loc.head_path is None:
            head = read_head(self.loc)
            if check is not None:
                check(head)
            return head
        try:
            # A regular file inside the store only (never a link, FIFO or device), read up to a bound.
            fd = self.loc.open_inside(HEAD_KEY, os.O_RDONLY)
        except FileNotFoundError:
            raise DamagedStoreError(f"{self.loc.url}: the commit record {HEAD_KEY} is missing (or not a file)") from None
        try:
            raw = pread(fd, MAX_HEAD_BYTES + 1, 0)
            head = Head.from_json(raw, str(self.loc.url))
            if check is not None:
                check(head)
        except BaseException:
            os.close(fd)
            raise
        self._watch(fd)
        return head

    def wrote(self) -> None:
        """This process just wrote the record (under the writer's lock): watch that file."""
        if self.loc.head_path is not None:
            self._watch(os.open(self.loc.head_path, os.O_RDONLY | OPEN_FLAGS))

    def _watch(self, fd: int) -> None:
        self.close()
        ino = _identity(os.fstat(fd))
        if _KEEP_WATCHED_OPEN:
            self._fd = fd
        else:
            os.close(fd)
        self._ino = ino

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._ino = -1, None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# Windows refuses to rename onto an open file (HeadWatch's docstring).
_KEEP_WATCHED_OPEN = os.name != "nt"


def _identity(st: os.stat_result) -> Any:
    """What tells one record file from the next (see :class:`HeadWatch`)."""
    return st.st_ino if _KEEP_WATCHED_OPEN else (st.st_ino, st.st_mtime_ns, st.st_size)


# -- the writer lock --------------------------------------------------------------------------
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
