"""Confinement of a local store (docs/design.md 3.7: a store is input): which files trajstore may
open, read, write or delete below a store's root, and how much of them it reads.

Every file of a local store goes through these checks: a key cannot climb out of the root, no
folder below the root and no final file may be a symbolic link (even one pointing inside: a
chunk linked to another chunk would be written twice), only regular files are read (a FIFO
would block forever, a device never ends), and files are read up to a bound.
:class:`ConfinedLocalStore` is zarr's ``LocalStore`` with those rules; :mod:`trajstore.storage`
builds every local :class:`~trajstore.storage.location.Location` on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import LocalStore

from trajstore.errors import DamagedStoreError, StoreFullError

__all__ = ["ConfinedLocalStore", "Confinement", "MAX_META_BYTES", "MAX_HEAD_BYTES", "MAX_FILE_BYTES",
           "HEAD_FILES", "ZARR_V2_META", "OPEN_FLAGS", "check_key", "file_kind", "full_disk", "pread", "pwrite",
           "read_limit"]


#: zarr.json files (the root one carries the consolidated metadata of every array).
MAX_META_BYTES = 16 << 20
#: The commit record (a few hundred bytes, plus the chunk list of a pending rewrite).
MAX_HEAD_BYTES = 1 << 20
#: Any other file read whole (a compressed chunk, a dataset description): above any chunk a
#: valid store holds (trajstore.storage.schema.MAX_CHUNK_BYTES plus codec overhead).
MAX_FILE_BYTES = 1 << 30

#: zarr format 2 metadata files (a foreign store opened in place or imported): read with the bound
#: of ``*.json`` metadata, parsed whole.
ZARR_V2_META = (".zarray", ".zgroup", ".zattrs", ".zmetadata")

#: The commit record and the copy of it a local writer keeps (trajstore.storage.head.PREV_KEY); both are
#: read with the commit record's bound.
HEAD_FILES = ("trajstore.head.json", "trajstore.head.prev.json")

# Flags of every open of a store's file.  Windows has no O_NOFOLLOW, O_NONBLOCK or O_CLOEXEC (its
# descriptors are not inherited anyway) but needs O_BINARY, or reads translate line ends.
_HAS_NOFOLLOW = hasattr(os, "O_NOFOLLOW")
OPEN_FLAGS = (getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
              | getattr(os, "O_BINARY", 0))
_NOFOLLOW_FLAGS = OPEN_FLAGS


def pread(fd: int, n: int, offset: int) -> bytes:
    """``os.pread`` where the system has it; elsewhere (Windows) a seek and a read loop, which is
    the same for the descriptors trajstore reads this way (each one private to its caller)."""
    if hasattr(os, "pread"):
        return os.pread(fd, n, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    parts, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def pwrite(fd: int, data: bytes, offset: int) -> int:
    """``os.pwrite`` where the system has it; elsewhere a seek and a write loop."""
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


# openat2(2) (Linux 5.6+) resolves a whole key in the kernel, refusing every symbolic link and any
# escape from the root (RESOLVE_BENEATH): the checks of Confinement.resolve in one system call and
# with no window between check and open.  Mapping a large store opens thousands of chunk files
# (one folder each), so this is what the first read after opening costs.
_SYS_OPENAT2 = 437  # one number on every Linux architecture (the unified syscall table)
_RESOLVE = 0x02 | 0x04 | 0x08  # RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_HOW_SIZE = ctypes.sizeof(_OpenHow)
# One open_how per flags value (a reference to it, ready to pass), built on first use rather than
# per open: a store's first read opens hundreds of chunk files.  The kernel only reads it, so
# threads share it; two threads racing to build one build equal ones.
_HOWS: dict[int, Any] = {}
# os.fsencode's encoding, without its per-call lookups (keys are str here).
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


_openat2_ok = sys.platform.startswith("linux") and hasattr(os, "O_PATH")
if _openat2_ok:
    try:  # a libc that ctypes cannot load (static builds, sandboxes): the portable path below
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        _openat2_ok = False


def _open_beneath(root: Path, key: str, flags: int, held: int | None = None) -> int | None:
    """An fd of ``key`` below ``root`` opened with openat2's confinement, or None when the system
    has no openat2 (or anything but a plain file or a missing one is met: the caller's slower
    path then says precisely what is wrong).  ``held``: an open ``O_PATH`` fd of ``root`` to
    resolve from (else ``root`` is opened for this call).

    Raises
    ------
    FileNotFoundError
        Nothing is at ``key`` (or a plain file is where a folder of the key should be).
    """
    global _openat2_ok
    if not _openat2_ok:
        return None
    how = _HOWS.get(flags)
    if how is None:
        how = _HOWS[flags] = ctypes.byref(_OpenHow(flags | _NOFOLLOW_FLAGS, 0, _RESOLVE))
    name = key.encode(_FS_ENCODING, _FS_ERRORS)
    if held is not None:
        fd = _syscall(_SYS_OPENAT2, held, name, how, _HOW_SIZE)
    else:
        try:
            dfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fd = _syscall(_SYS_OPENAT2, dfd, name, how, _HOW_SIZE)
        finally:
            os.close(dfd)
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.ENOTDIR) and not flags & (os.O_WRONLY | os.O_RDWR):
        raise FileNotFoundError(errno.ENOENT, "no such file", str(root / key))
    if err in (errno.ENOSYS, errno.EPERM):  # an old kernel, or a sandbox that filters the call
        _openat2_ok = False
    return None


def read_limit(key: str) -> int:
    """The most bytes a whole-file read of ``key`` may return."""
    name = key.rsplit("/", 1)[-1]
    if name in HEAD_FILES:
        return MAX_HEAD_BYTES
    if name.endswith(".json") or name in ZARR_V2_META:
        return MAX_META_BYTES
    return MAX_FILE_BYTES


# A part of a key that is "." or "..".  (\Z: "$" would also match before a final newline.)
_DOT_PART = re.compile(r"(?:\A|/)\.{1,2}(?:/|\Z)")


def check_key(key: str, where: Any = None) -> None:
    """Refuse a key that could name something outside the store (absolute, ``..``, empty parts).

    Raises
    ------
    DamagedStoreError
        Naming ``where`` (the store) and the key.
    """
    # Checked on every open of a chunk file: string tests (an empty part is an empty key, a "/" at
    # either end or "//"), the search for dot parts only where there is a dot; splitting the key
    # and testing each part cost three times as much (0.36 against 1.04 us).
    if not isinstance(key, str) or not key or key[0] == "/" or key[-1] == "/" or "//" in key or "\x00" in key \
            or ("." in key and _DOT_PART.search(key)):
        raise DamagedStoreError(f"{where}: key {key!r} is not a relative path inside the store (empty parts, '.', "
                                "'..' and absolute paths are refused)")


def not_a_folder(url: str, rel: str, mode: int) -> DamagedStoreError:
    """The error for something other than a real folder (``mode``, from ``lstat``) at ``rel``."""
    return DamagedStoreError(f"{url}: {rel!r} is a {file_kind(mode)} where a folder is expected; "
                             "trajstore never follows links or enters special files inside a store")


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words for messages (``"file"``, ``"symbolic link"``, ``"FIFO"``...)."""
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


class Confinement:
    """Turns keys into paths under one local ``root`` that never pass through a symbolic link.

    Folders already found to be real folders are remembered, so a key costs one ``lstat`` per
    new folder and none on later calls (a chunk file open stays one ``open`` + ``fstat``).
    """

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url
        self._dirs: set[str] = set()
        self._held: tuple[int, int] | None = None  # (thread id, O_PATH fd of root) inside held_root()

    @contextlib.contextmanager
    def held_root(self) -> Iterator[None]:
        """Resolve the root once for the opens of this block (mapping a store's chunk files: a
        fresh open of the root per file was a fifth of the cost of mapping it).  Only the calling
        thread uses the held fd, which is closed when the block ends; nested blocks share it."""
        if self._held is not None or not _openat2_ok:
            yield
            return
        try:
            fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            yield
            return
        self._held = (threading.get_ident(), fd)
        try:
            yield
        finally:
            self._held = None
            os.close(fd)

    def folder_fd(self, rel: str, root_fd: int | None = None) -> int | None:
        """An open fd (``O_RDONLY | O_DIRECTORY``, the caller closes it) of the folder ``rel``
        below the root (``""``: the root itself), resolved by openat2 with no link anywhere on the
        way, from ``root_fd`` if given; None where that does not apply: no openat2, or nothing,
        a link or a file at ``rel`` (the path-based calls then create folders or say what is wrong).
        """
        if not _openat2_ok:
            return None
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        if not rel:
            try:
                return os.open(self.root, flags)
            except OSError:
                return None
        check_key(rel, self.url)
        try:
            return _open_beneath(self.root, rel, flags, root_fd)
        except FileNotFoundError:
            return None

    def resolve(self, key: str, *, folder: bool = False, write: bool = False) -> tuple[Path, bool]:
        """``(path, reachable)`` of ``key``: every existing folder on the way (and ``key`` itself
        when ``folder``) is checked to be a real folder.  ``reachable`` is False when one of them
        is a plain file (then nothing exists at the key; a writer gets an error instead).

        Raises
        ------
        DamagedStoreError
            A bad key, or a folder on the way that is a symbolic link or a special file.
        """
        check_key(key, self.url)
        parts = key.split("/")
        rel = ""
        for part in parts if folder else parts[:-1]:
            rel = f"{rel}/{part}" if rel else part
            if rel in self._dirs:
                continue
            try:
                st = os.lstat(self.root / rel)
            except (FileNotFoundError, NotADirectoryError):
                break  # the rest does not exist yet (a writer creates real folders)
            if stat.S_ISDIR(st.st_mode):
                self._dirs.add(rel)
                continue
            if stat.S_ISREG(st.st_mode) and not write:
                return self.root / key, False
            raise not_a_folder(self.url, rel, st.st_mode)
        return self.root / key, True

    def forget(self, rel: str) -> None:
        """A folder (and everything below) was deleted: check it again if it comes back."""
        self._dirs = {d for d in self._dirs if d != rel and not d.startswith(rel + "/")}

    def open(self, key: str, flags: int) -> int:
        """An fd of the regular file ``key`` (``flags`` as for ``os.open``, without ``O_CREAT``).

        Raises
        ------
        FileNotFoundError
            Nothing (or a folder, when reading) is at ``key``.
        DamagedStoreError
            ``key`` is a symbolic link, a FIFO, a device or another special file.
        """
        return self.open_stat(key, flags)[0]

    def open_stat(self, key: str, flags: int) -> tuple[int, os.stat_result]:
        """:meth:`open`, with the ``fstat`` of the open file that showed it to be a regular file
        (a caller that needs the size asks the system once, not twice: mapping a chunk file).
        Raises what :meth:`open` raises."""
        check_key(key, self.url)
        held = self._held
        fd = _open_beneath(self.root, key, flags, held[1] if held and held[0] == threading.get_ident() else None)
        if fd is not None:
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            if stat.S_ISREG(st.st_mode):
                return fd, st
            os.close(fd)  # a folder or a special file: the checks below name it
        path, ok = self.resolve(key, write=bool(flags & (os.O_WRONLY | os.O_RDWR)))
        if not ok:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        if not _HAS_NOFOLLOW:
            # No O_NOFOLLOW (Windows): refuse a link seen just before the open (a narrower check:
            # a link swapped in between the two calls is followed).
            try:
                if stat.S_ISLNK(os.lstat(path).st_mode):
                    raise DamagedStoreError(f"{self.url}: {key} is a symbolic link, not a regular file; trajstore "
                                            "never follows links inside a store")
            except (FileNotFoundError, NotADirectoryError):
                raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
        try:
            fd = os.open(path, flags | _NOFOLLOW_FLAGS)
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
        except IsADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "a folder, not a file", str(path)) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):  # ENXIO: a FIFO opened for writing
                mode = os.lstat(path).st_mode
                raise DamagedStoreError(f"{self.url}: {key} is a {file_kind(mode)}, not a regular file; trajstore "
                                        "never follows links or opens special files inside a store") from None
            raise
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        mode = st.st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise FileNotFoundError(errno.ENOENT, "a folder, not a file", str(path))
            raise DamagedStoreError(f"{self.url}: {key} is a {file_kind(mode)}, not a regular file; trajstore "
                                    "never opens special files inside a store")
        return fd, st

    def read(self, key: str, limit: int | None = None, byte_range: ByteRequest | None = None) -> bytes | None:
        """Bytes of ``key`` (or of ``byte_range`` of it); ``None`` when nothing is there.

        Raises
        ------
        DamagedStoreError
            Not a regular file, or more than ``limit`` bytes (default :func:`read_limit`) to read.
        """
        try:
            fd, st = self.open_stat(key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = st.st_size
            lo, hi = 0, size
            if isinstance(byte_range, RangeByteRequest):
                lo, hi = byte_range.start, min(byte_range.end, size)
            elif isinstance(byte_range, OffsetByteRequest):
                lo = byte_range.offset
            elif isinstance(byte_range, SuffixByteRequest):
                lo = max(0, size - byte_range.suffix)
            elif byte_range is not None:
                raise TypeError(f"unexpected byte_range {byte_range!r}")
            limit = read_limit(key) if limit is None else limit
            if hi - lo > limit:
                raise DamagedStoreError(f"{self.url}: {key} holds {size} bytes; at most {limit} are expected there")
            parts, pos = [], lo
            while pos < hi:  # the file may shrink meanwhile; it can never make us read past `hi`
                b = pread(fd, min(hi - pos, 64 << 20), pos)
                if not b:
                    break
                parts.append(b)
                pos += len(b)
            return b"".join(parts)
        finally:
            os.close(fd)

    def is_file(self, key: str) -> bool:
        """Something that is not a folder is at ``key`` (a link counts: opening it is refused later)."""
        path, ok = self.resolve(key)
        if not ok:
            return False
        try:
            return not stat.S_ISDIR(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def makedirs(self, key: str) -> Path:
        """Create the folders of ``key`` (its parents); none of them may be a link. Returns the path."""
        path, _ok = self.resolve(key, write=True)
        for _ in range(100):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                break
            except FileExistsError:
                # mkdir saw the folder, and it was gone when pathlib checked it: another writer
                # removed an empty temp folder in between (exclusive_put).  Make it again.
                continue
        else:
            raise DamagedStoreError(f"{self.url}: {key!r}: something that is not a folder stands where its "
                                    "folder belongs")
        self.resolve(key, write=True)  # what was just created is a real folder (a race would show here)
        return path

    def remove(self, key: str, *, folder_ok: bool = True, keep_folder: bool = False) -> None:
        """Delete ``key``: a link is unlinked (never followed), a folder removed with everything in it
        (``shutil.rmtree`` does not follow links below it), a missing key ignored.  With
        ``keep_folder``, a real folder at ``key`` is emptied instead and stays (its next file then
        costs no ``mkdir``: a writer's open empties the temp folder its first commit writes into)."""
        path, ok = self.resolve(key, write=True)
        if not ok:
            return
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISDIR(mode):
            if not folder_ok:
                raise IsADirectoryError(errno.EISDIR, "a folder, not a file", str(path))
            if keep_folder:
                # Errors ignored as rmtree's below are: what cannot be removed stays (temp names are
                # never reused), and opening the store does not fail over it.
                with contextlib.suppress(OSError), os.scandir(path) as entries:
                    for e in entries:  # any name (a tampered store's too); links unlinked, never entered
                        if e.is_dir(follow_symlinks=False):
                            shutil.rmtree(e.path, ignore_errors=True)
                        else:
                            with contextlib.suppress(OSError):
                                os.unlink(e.path)
            else:
                shutil.rmtree(path, ignore_errors=True)
            self.forget(key)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def walk_files(self, prefix: str) -> list[str]:
        """Keys of the files (any non-folder) under folder ``prefix`` (``""``: the root); links to
        folders are listed as files and never entered."""
        if prefix:
            base, ok = self.resolve(prefix, folder=True)
            if not ok:
                return []
        else:
            base = self.root
        out = []
        for dirpath, dirs, files in os.walk(base):  # followlinks=False: a linked folder is not entered
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
                out.append(name if rel_dir == "." else f"{rel_dir}/{name}")
        return sorted(out)


class ConfinedLocalStore(LocalStore):
    """zarr's ``LocalStore`` with trajstore's confinement: zarr's own reads and writes of
    metadata and chunks never follow a symbolic link below the root, never open a FIFO or a
    device, and never read a file larger than :func:`read_limit` allows.

    Offending keys raise :class:`~trajstore.errors.DamagedStoreError`; missing keys (and
    folders where a file is expected) read as missing, as in zarr.
    """

    @property
    def _conf(self) -> Confinement:
        conf = self.__dict__.get("_confinement")
        if conf is None:
            conf = self.__dict__["_confinement"] = Confinement(self.root, str(self.root))
        return conf

    def _read(self, key: str, prototype: BufferPrototype | None, byte_range: ByteRequest | None) -> Buffer | None:
        data = self._conf.read(key, None, byte_range)
        return None if data is None else (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    def get_sync(self, key: str, *, prototype: BufferPrototype | None = None,
                 byte_range: ByteRequest | None = None) -> Buffer | None:
        self._ensure_open_sync()
        return self._read(key, prototype, byte_range)

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if not self._is_open:
            await self._open()
        return await asyncio.to_thread(self._read, key, prototype, byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    def set_sync(self, key: str, value: Buffer) -> None:
        self._conf.makedirs(key)
        super().set_sync(key, value)

    async def _set(self, key: str, value: Buffer, exclusive: bool = False) -> None:
        self._conf.makedirs(key)
        await super()._set(key, value, exclusive)

    def delete_sync(self, key: str) -> None:
        self._ensure_open_sync()
        self._check_writable()
        self._conf.remove(key)

    async def delete(self, key: str) -> None:
        self._check_writable()
        self._conf.remove(key)

    async def delete_dir(self, prefix: str) -> None:
        self._check_writable()
        if prefix.strip("/"):
            self._conf.remove(prefix.strip("/"))

    async def exists(self, key: str) -> bool:
        path, ok = self._conf.resolve(key)
        if not ok:
            return False
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def list_prefix(self, prefix: str) -> Any:
        for key in self._conf.walk_files(prefix.strip("/")):
            yield key

    async def list(self) -> Any:
        for key in self._conf.walk_files(""):
            yield key

    async def list_dir(self, prefix: str) -> Any:
        prefix = prefix.strip("/")
        if prefix:
            base, ok = self._conf.resolve(prefix, folder=True)
            if not ok:
                return
        else:
            base = self.root
        try:
            names = sorted(os.listdir(base))
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            yield name


_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def full_disk(e: OSError, path: Any, what: str) -> OSError:
    """``e`` as a :class:`StoreFullError` naming ``path`` and what failed, when it says the
    filesystem is full; otherwise ``e`` itself (EIO and friends keep their type)."""
    if isinstance(e, StoreFullError) or e.errno not in _FULL:
        return e
    assert e.errno is not None  # it is in _FULL
    err = StoreFullError(e.errno, f"{what}: {os.strerror(e.errno)}; free space and write again (rows committed "
                                  "before stay intact)", os.fspath(path) if path is not None else None)
    err.__cause__ = e
    return err


