"""The commit record (``trajstore.head.json``), its previous copy, and the watch readers keep on it.

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

The writer lock is :mod:`trajstore.storage.locks`.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from trajstore.errors import DamagedStoreError, FormatVersionError
from trajstore.storage.confined import MAX_HEAD_BYTES, OPEN_FLAGS, pread, pwrite
from trajstore.storage.keys import (
    FORMAT_VERSION,
    HEAD_KEY,
    LOCK_KEY,
    MPLOCK_KEY,
    PREV_KEY,
)
from trajstore.storage.location import Location
from trajstore.storage.mounts import fs_type, mounts
from trajstore.storage.schema import check_int, load_json

__all__ = ["HEAD_KEY", "PREV_KEY", "LOCK_KEY", "MPLOCK_KEY", "FORMAT_VERSION", "TableState", "Head", "read_head",
           "write_head", "read_prev", "sync_prev", "HeadWatch"]



@dataclass
class TableState:
    """Committed rows ``[start, end)`` (absolute numbers) and the rows allocated in the arrays."""

    start: int = 0
    end: int = 0
    allocated: int = 0

    @property
    def count(self) -> int:
        """Committed rows, ``end - start``."""
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
        """An independent copy (tables, ``state`` and ``pending`` copied too), to change and commit."""
        # Field by field: a deepcopy per commit costs more than writing the record.
        tables = {k: TableState(t.start, t.end, t.allocated) for k, t in self.tables.items()}
        return Head(self.generation, self.epoch, tables, copy.deepcopy(self.state) if self.state else {},
                    copy.deepcopy(self.pending) if self.pending else None)

    def to_json(self) -> bytes:
        """The record as compact UTF-8 JSON, as ``trajstore.head.json`` holds it (with ``format_version``)."""
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
    loc.record_written(data)  # a transactional location (icechunk) commits the record with its data


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
    """Tells, for the cost of one ``stat`` (or ``fstat``), whether the local commit record was
    replaced since this process last read or wrote it.

    A record is replaced by rename, so each one is a new file.  The watch keeps the file it
    last saw open: while it is open, its inode number cannot go to a later file, so comparing
    inode numbers is exact.  (Modification time and size are not: two commits within one clock
    tick, the second reusing the first one's freed inode, can leave all three equal.)

    Once the record has *settled* (its last status change, ctime, is :data:`SETTLED_NS` old) on a
    filesystem of :data:`FSTAT_FS`, the watch asks the file it holds open instead of the path:
    ``fstat`` of it, without a path lookup.  A rename onto the record drops the replaced file's
    link count inside the rename call (a removal too), and any change of its link count sets its
    ctime to the present, which a settled ctime cannot equal even on a filesystem of 2 s
    timestamps; so an unchanged (link count, ctime) pair proves the file is still the record.  A
    young record (rewrites may follow within one timestamp tick) and other filesystems (overlay,
    whose files in a lower layer keep their own link count when renamed over; network and FUSE
    mounts, whose attributes may be cached) are asked by ``stat`` of the path, as is any
    settled record whose pair changed.

    Windows cannot rename onto a file another process holds open, so there the watch keeps no
    file open and compares (file id, modification time, size) instead: NTFS file ids are not
    reused as promptly as ext4 inodes, but this is a weaker check than on POSIX systems.
    """

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self._fd = -1
        self._ino: int | None = None  # None: nothing watched yet, so the record counts as changed
        # (link count, ctime) of the watched file once it settled: fstat answers while they hold.
        self._settled: tuple[int, int] | None = None
        self._fstat_fs: bool | None = None  # whether the record's filesystem is in FSTAT_FS (looked up once)
        # Called with every record read, before it is returned (the store's schema checks).
        self.check: Callable[[Head], None] | None = None

    def changed(self) -> bool:
        """Whether the record may differ from the one last read or written (always True for
        stores without a local head file)."""
        if self._settled is not None:
            st = os.fstat(self._fd)
            if (st.st_nlink, st.st_ctime_ns) == self._settled:
                return False
            self._settled = None  # replaced, linked, or its mode or owner changed: ask the path
        if self.loc.head_path is None or self._ino is None:
            return True
        try:
            st = os.stat(self.loc.head_path)
        except FileNotFoundError:
            return True
        if _identity(st) != self._ino:
            return True
        # ``st`` is the watched file itself (same inode, held open).
        if self._fd >= 0 and self._fstat_fs is not False and st.st_ctime_ns <= _now_ns() - SETTLED_NS \
                and self._on_fstat_fs():
            self._settled = (st.st_nlink, st.st_ctime_ns)
        return False

    def _on_fstat_fs(self) -> bool:
        if self._fstat_fs is None:
            assert self.loc.head_path is not None  # (a watched file is a local record)
            self._fstat_fs = fs_type(os.path.dirname(self.loc.head_path), mounts()) in FSTAT_FS
        return self._fstat_fs

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
        """Close the watched file; until the next read or write the record counts as changed."""
        self._settled = None
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

#: Age of its ctime (ns) from which a watched record is asked by ``fstat`` (:class:`HeadWatch`):
#: above the coarsest timestamps a filesystem of :data:`FSTAT_FS` keeps (ext2/3: 1 s).
SETTLED_NS = 3_000_000_000
#: Filesystems on which a file renamed over, or removed, shows a lower link count to ``fstat``
#: of a descriptor held open (local, changed only through this kernel; not overlay: see
#: :class:`HeadWatch`).
FSTAT_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs"})


def _now_ns() -> int:
    """The wall clock that file timestamps are taken from (a seam for the tests)."""
    return time.time_ns()


def _identity(st: os.stat_result) -> Any:
    """What tells one record file from the next (see :class:`HeadWatch`)."""
    return st.st_ino if _KEEP_WATCHED_OPEN else (st.st_ino, st.st_mtime_ns, st.st_size)
