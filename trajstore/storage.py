"""Where a store lives: resolving ``cache_path`` to a zarr store, and the key/value
operations the commit protocol needs (atomic put, rename, listing) on top of it.

A :class:`Location` wraps one zarr ``Store`` (``LocalStore``, ``FsspecStore``,
``MemoryStore`` or ``ZipStore``).  Local folders additionally expose ``local_root``
so that the fast paths (memory-mapped chunk files, ``os.replace``, ``fsync``,
``flock``) can bypass zarr-python; every other store goes through zarr's own API.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import zarr
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, MemoryStore, ZipStore

from .errors import DamagedStoreError, NotATrajstoreError, ReadOnlyError, StoreFullError, StoreNotFoundError

__all__ = ["Location", "resolve_location", "TMP_DIR", "STAGING_DIR", "ConfinedLocalStore", "MAX_META_BYTES",
           "MAX_HEAD_BYTES", "MAX_FILE_BYTES", "check_key"]

# Our own temp files live in one folder at the store root (same filesystem, so
# ``os.replace`` stays atomic); a writer that opens the store clears it.
TMP_DIR = ".trajstore-tmp"
# Chunks of an operation that rewrites committed rows (set_at, remove_at) are
# staged here first and moved into place after the commit record names them.
STAGING_DIR = ".trajstore-staging"

# zarr warns that consolidated metadata is not part of the v3 spec on every call.
warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part", category=UserWarning)


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


# -- confinement (DESIGN.md 3.7: a store is input) ----------------------------------------
# Every file of a store is opened through these checks: the key cannot climb out of the root,
# no folder below the root and no final file may be a symbolic link (even one pointing inside:
# a chunk linked to another chunk would be written twice), only regular files are read (a FIFO
# would block forever, a device never ends), and files are read up to a bound.

#: zarr.json files (the root one carries the consolidated metadata of every array).
MAX_META_BYTES = 16 << 20
#: The commit record (a few hundred bytes, plus the chunk list of a pending rewrite).
MAX_HEAD_BYTES = 1 << 20
#: Any other file read whole (a compressed chunk, a dataset description): above any chunk a
#: valid store holds (trajstore.schema.MAX_CHUNK_BYTES plus codec overhead).
MAX_FILE_BYTES = 1 << 30

_NOFOLLOW_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_limit(key: str) -> int:
    """The most bytes a whole-file read of ``key`` may return."""
    name = key.rsplit("/", 1)[-1]
    if name == "trajstore.head.json":
        return MAX_HEAD_BYTES
    if name.endswith(".json"):
        return MAX_META_BYTES
    return MAX_FILE_BYTES


def check_key(key: str, where: Any = None) -> None:
    """Refuse a key that could name something outside the store (absolute, ``..``, empty parts).

    Raises
    ------
    DamagedStoreError
        Naming ``where`` (the store) and the key.
    """
    if not isinstance(key, str) or not key or key.startswith("/") or "\x00" in key \
            or any(p in ("", ".", "..") for p in key.split("/")):
        raise DamagedStoreError(f"{where}: key {key!r} is not a relative path inside the store (empty parts, '.', "
                                "'..' and absolute paths are refused)")


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


class _Confinement:
    """Turns keys into paths under one local ``root`` that never pass through a symbolic link.

    Folders already found to be real folders are remembered, so a key costs one ``lstat`` per
    new folder and none on later calls (a chunk file open stays one ``open`` + ``fstat``).
    """

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url
        self._dirs: set[str] = set()

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
            raise DamagedStoreError(f"{self.url}: {rel!r} is a {_file_kind(st.st_mode)} where a folder is expected; "
                                    "trajstore never follows links or enters special files inside a store")
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
        path, ok = self.resolve(key, write=bool(flags & (os.O_WRONLY | os.O_RDWR)))
        if not ok:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        try:
            fd = os.open(path, flags | _NOFOLLOW_FLAGS)
        except NotADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path)) from None
        except IsADirectoryError:
            raise FileNotFoundError(errno.ENOENT, "a folder, not a file", str(path)) from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):  # ENXIO: a FIFO opened for writing
                mode = os.lstat(path).st_mode
                raise DamagedStoreError(f"{self.url}: {key} is a {_file_kind(mode)}, not a regular file; trajstore "
                                        "never follows links or opens special files inside a store") from None
            raise
        try:
            mode = os.fstat(fd).st_mode
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise FileNotFoundError(errno.ENOENT, "a folder, not a file", str(path))
            raise DamagedStoreError(f"{self.url}: {key} is a {_file_kind(mode)}, not a regular file; trajstore "
                                    "never opens special files inside a store")
        return fd

    def read(self, key: str, limit: int | None = None, byte_range: ByteRequest | None = None) -> bytes | None:
        """Bytes of ``key`` (or of ``byte_range`` of it); ``None`` when nothing is there.

        Raises
        ------
        DamagedStoreError
            Not a regular file, or more than ``limit`` bytes (default :func:`read_limit`) to read.
        """
        try:
            fd = self.open(key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
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
                b = os.pread(fd, min(hi - pos, 64 << 20), pos)
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
        path.parent.mkdir(parents=True, exist_ok=True)
        self.resolve(key, write=True)  # what was just created is a real folder (a race would show here)
        return path

    def remove(self, key: str, *, folder_ok: bool = True) -> None:
        """Delete ``key``: a link is unlinked (never followed), a folder removed with everything in it
        (``shutil.rmtree`` does not follow links below it), a missing key ignored."""
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
    def _conf(self) -> _Confinement:
        conf = self.__dict__.get("_confinement")
        if conf is None:
            conf = self.__dict__["_confinement"] = _Confinement(self.root, str(self.root))
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


_FULL = (errno.ENOSPC, errno.EDQUOT)


def full_disk(e: OSError, path: Any, what: str) -> OSError:
    """``e`` as a :class:`StoreFullError` naming ``path`` and what failed, when it says the
    filesystem is full; otherwise ``e`` itself (EIO and friends keep their type)."""
    if isinstance(e, StoreFullError) or e.errno not in _FULL:
        return e
    err = StoreFullError(e.errno, f"{what}: {os.strerror(e.errno)}; free space and write again (rows committed "
                                  "before stay intact)", os.fspath(path) if path is not None else None)
    err.__cause__ = e
    return err


class Location:
    """One store's address plus byte-level access to its keys.

    Parameters
    ----------
    zstore : zarr.abc.store.Store
        The zarr store holding the group.
    url : str or None
        What the user passed as ``cache_path`` (``None`` for an in-memory store).
    local_root : Path or None
        Filesystem folder of the store when it is a plain local folder.
    """

    def __init__(self, zstore: Any, url: str | None, local_root: Path | None) -> None:
        self.zstore = zstore
        self.url = url
        self.local_root = local_root
        self.head_path = None if local_root is None else str(local_root / "trajstore.head.json")
        self._conf: _Confinement | None = None
        if local_root is not None:
            conf = getattr(zstore, "_conf", None)  # share the folder checks with the zarr store
            self._conf = conf if isinstance(conf, _Confinement) else _Confinement(local_root, str(url))

    # -- identity ---------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return bool(self.zstore.read_only)

    @property
    def is_local(self) -> bool:
        return self.local_root is not None

    def __repr__(self) -> str:
        return f"Location({self.url!r}, read_only={self.read_only})"

    def _check_writable(self) -> None:
        if self.read_only:
            raise ReadOnlyError(f"store {self.url!r} is open read-only; nothing may be written")

    def path(self, key: str) -> Path:
        """Filesystem path of ``key`` (local stores only), checked to stay inside the root: the key
        has no ``..`` or absolute part and no existing folder on the way is a symbolic link.

        The final component is not checked here: open it with :meth:`open_inside` (or with
        ``O_NOFOLLOW``), never with a plain ``open``.

        Raises
        ------
        DamagedStoreError
            The key or a folder on the way would leave the store.
        """
        assert self._conf is not None
        return self._conf.resolve(key)[0]

    def open_inside(self, key: str, flags: int) -> int:
        """Open the regular file ``key`` (local stores only) for ``os.open`` ``flags`` (no ``O_CREAT``),
        refusing symbolic links (the final file and every folder on the way), FIFOs and devices.

        Returns a file descriptor the caller closes.

        Raises
        ------
        FileNotFoundError
            Nothing is at ``key`` (or a folder is).
        DamagedStoreError
            ``key`` leaves the store, is a link or a special file.
        """
        assert self._conf is not None
        return self._conf.open(key, flags)

    # -- key/value --------------------------------------------------------------------
    def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        """Bytes stored under ``key``, or ``None`` when it does not exist.

        At most ``limit`` bytes (default: :func:`read_limit` of the key, 16 MiB for ``*.json``)
        are accepted; locally only a regular file inside the root is read.

        Raises
        ------
        DamagedStoreError
            The key is a link, a FIFO, a device, or holds more than ``limit`` bytes.
        """
        limit = read_limit(key) if limit is None else limit
        if self._conf is not None:
            return self._conf.read(key, limit)
        check_key(key, self.url)
        buf = sync(self.zstore.get(key, prototype=default_buffer_prototype()))
        if buf is None:
            return None
        if len(buf) > limit:
            raise DamagedStoreError(f"{self.url}: {key} holds {len(buf)} bytes; at most {limit} are expected there")
        return buf.to_bytes()

    def exists(self, key: str) -> bool:
        """A file (locally: anything but a folder, links included) is stored under ``key``."""
        if self._conf is not None:
            return self._conf.is_file(key)
        return bool(sync(self.zstore.exists(key)))

    def put(self, key: str, data: bytes, *, fsync: bool = False) -> None:
        """Write ``data`` under ``key`` atomically: readers see the old or the new bytes, never a mix.

        Locally: write a temp file, optionally ``fsync`` it, ``os.replace`` it onto the key (a link
        there is replaced, never written through), and (with ``fsync``) ``fsync`` the folder.
        Elsewhere: a single store ``set`` (one PUT).
        """
        self._check_writable()
        if self._conf is None:
            check_key(key, self.url)
            sync(self.zstore.set(key, default_buffer_prototype().buffer.from_bytes(data)))
            return
        dest = self._conf.makedirs(key)
        tmp = self.new_tmp_path()
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, dest)
        except OSError as e:
            tmp.unlink(missing_ok=True)  # the old bytes stay under the key
            raise full_disk(e, dest, f"write {key}") from e
        if fsync:
            fsync_dir(dest.parent)

    def new_tmp_path(self) -> Path:
        """A fresh temp file path inside the store (local stores only; create it with ``"xb"`` or
        ``O_EXCL``: the folder is checked to be a real folder of the store)."""
        assert self._conf is not None
        tmp = self._conf.makedirs(f"{TMP_DIR}/{uuid.uuid4().hex}")
        return tmp

    def delete(self, key: str) -> None:
        """Remove the file ``key`` (a link is unlinked, never followed; a missing key is ignored)."""
        self._check_writable()
        if self._conf is not None:
            self._conf.remove(key)
            return
        check_key(key, self.url)
        sync(self.zstore.delete(key))

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` onto ``dst`` (atomic locally; a copy then delete elsewhere).

        Raises
        ------
        DamagedStoreError
            Locally, ``src`` is not a regular file (a link is never moved into place).
        """
        self._check_writable()
        if self._conf is not None:
            fd = self._conf.open(src, os.O_RDONLY)  # refuses links and special files
            os.close(fd)
            dest = self._conf.makedirs(dst)
            os.replace(self._conf.resolve(src)[0], dest)
            return
        data = self.get(src)
        if data is None:
            raise FileNotFoundError(src)
        self.put(dst, data)
        self.delete(src)

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (a folder name without trailing slash; ``""`` for all).

        Locally, links are listed (as keys) but never entered."""
        if self._conf is not None:
            return self._conf.walk_files(prefix)
        pre = prefix + "/" if prefix else ""

        async def _collect() -> list[str]:
            return [k async for k in self.zstore.list_prefix(pre)]

        return sorted(sync(_collect()))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``.  Locally a link at ``prefix`` (or below) is unlinked,
        never followed: nothing outside the store is deleted."""
        self._check_writable()
        if self._conf is not None:
            self._conf.remove(prefix)
            return
        for key in self.list_prefix(prefix):
            self.delete(key)

    def iter_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """``(key, nbytes)`` for every key under ``prefix``; locally the bytes the file occupies on
        disk (a file made sparse by an older trajstore only holds the pages written; a link counts
        its own size, never its target's)."""
        if self._conf is not None:
            for key in self.list_prefix(prefix):
                try:
                    st = os.lstat(self._conf.resolve(key)[0])
                except (FileNotFoundError, NotADirectoryError):
                    continue
                yield key, min(st.st_size, st.st_blocks * 512)
            return
        for key in self.list_prefix(prefix):
            yield key, int(sync(self.zstore.getsize(key)))

    def close(self) -> None:
        try:
            self.zstore.close()
        except Exception:  # closing a store twice or a store without close is harmless ...
            from ._zipstore import ZipWriter

            if isinstance(self.zstore, ZipWriter):
                raise  # ... but closing a zip being written is what publishes it



def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve_location(
    cache_path: str | os.PathLike[str] | None,
    *,
    read_only: bool,
    storage_options: dict[str, Any] | None = None,
    must_exist: bool,
) -> Location:
    """Turn a user's ``cache_path`` into a :class:`Location`.

    ``None`` gives a fresh in-memory store; a path ending in ``.zip`` a ``ZipStore``; a URL
    (``s3://``, ``memory://``, ``file://``, chained ``simplecache::s3://``...) an fsspec store
    with ``storage_options``; anything else a local folder.

    Raises
    ------
    StoreNotFoundError
        ``must_exist`` and there is nothing at the path.
    """
    if cache_path is None:
        if must_exist:
            raise StoreNotFoundError("an in-memory store (cache_path=None) cannot be re-opened by path")
        return Location(MemoryStore(), None, None)
    path = os.fspath(cache_path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if not _is_url(path) and path.endswith(".zip"):
        if must_exist and not os.path.exists(path):
            raise StoreNotFoundError(f"no store at {path!r}: the file does not exist")
        # A zip is written once, start to end (dumps/copy), and read-only afterwards: it cannot
        # be updated in place.  So a writer never opens an existing zip (refused before the file
        # is touched), and a new zip is written beside the path and renamed onto it when done
        # (trajstore._zipstore: an existing zip is never truncated, a failed copy leaves it whole).
        from ._zipstore import ZipWriter, zip_read_only_error

        if read_only:
            zstore = ZipStore(path, mode="r")
            sync(zstore._open())
        elif must_exist:
            raise zip_read_only_error(path)
        else:
            zstore = ZipWriter(path)
        return Location(zstore, path, None)
    if _is_url(path):
        store = FsspecStore.from_url(path, storage_options=storage_options or {}, read_only=read_only)
        loc = Location(store, path, None)
        if must_exist and not loc.exists("zarr.json"):
            raise StoreNotFoundError(f"no store at {path!r}: zarr.json not found")
        return loc
    root = Path(path).expanduser().absolute()
    if must_exist and not root.exists():
        raise StoreNotFoundError(f"no store at {str(root)!r}: the folder does not exist")
    if root.exists() and not root.is_dir():  # the user's own path may be a link to a folder
        raise NotATrajstoreError(f"{str(root)!r} is a {_file_kind(os.stat(root).st_mode)}, not a folder; a local "
                                 "store is a folder")
    if not read_only:
        root.mkdir(parents=True, exist_ok=True)
    return Location(ConfinedLocalStore(root, read_only=read_only), str(root), root)


def open_zarr_group(loc: Location, *, mode: str) -> zarr.Group:
    """Open the root group, preferring consolidated metadata (one request on remote stores)."""
    return zarr.open_group(loc.zstore, mode=mode, use_consolidated=None if mode == "r" else False)
