"""Where a store lives: resolving ``cache_path`` to a zarr store, and the key/value
operations the commit protocol needs (atomic put, rename, listing) on top of it.

A :class:`Location` wraps one zarr ``Store`` (``LocalStore``, ``FsspecStore``,
``MemoryStore`` or ``ZipStore``).  Local folders additionally expose ``local_root``
so that the fast paths (memory-mapped chunk files, ``os.replace``, ``fsync``,
``flock``) can bypass zarr-python; every other store goes through zarr's own API.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator, Literal, overload

import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, MemoryStore, ZipStore

from trajstore.errors import (
    DamagedStoreError,
    NotATrajstoreError,
    ReadOnlyError,
    StoreNotFoundError,
)
from trajstore.storage._replace import replace_file
from trajstore.storage.chunk_cache import ChunkCache
from trajstore.storage.confined import (
    OPEN_FLAGS,
    ConfinedLocalStore,
    Confinement,
    check_key,
    file_kind,
    full_disk,
    not_a_folder,
    read_limit,
)
from trajstore.storage.spans import PutData, join_pieces, write_pieces

__all__ = ["Location", "resolve_location", "fsspec_options", "open_zarr_group", "fsync_dir", "TMP_DIR", "STAGING_DIR"]

# Our own temp files live in one folder at the store root (same filesystem, so
# ``os.replace`` stays atomic); a writer that opens the store clears it.
TMP_DIR = ".trajstore-tmp"
# Chunks of an operation that rewrites committed rows (set_at, remove_at) are
# staged here first and moved into place after the commit record names them.
STAGING_DIR = ".trajstore-staging"

#: Requests :meth:`Location.get_many` keeps in flight on a non-local store.
GET_CONCURRENCY = 64

# zarr warns that consolidated metadata is not part of the v3 spec on every call.
warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part", category=UserWarning)


def _is_url(path: str) -> bool:
    return "://" in path or "::" in path


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
        self.chunk_cache: ChunkCache | None = None  # opt-in, remote stores (resolve_location)
        # A transactional location's session (storage/icechunk_location.py): each commit record
        # written ends one of its commits.
        self.transaction: Any = None
        self._conf: Confinement | None = None
        if local_root is not None:
            conf = getattr(zstore, "_conf", None)  # share the folder checks with the zarr store
            self._conf = conf if isinstance(conf, Confinement) else Confinement(local_root, str(url))

    # -- identity ---------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        """Whether the zarr store was opened read-only (writes raise ``ReadOnlyError``)."""
        return bool(self.zstore.read_only)

    @property
    def is_local(self) -> bool:
        """Whether the store is a plain local folder (memory maps, lock files, ``path``)."""
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

    def held_root(self) -> contextlib.AbstractContextManager[None]:
        """A block in which :meth:`open_inside` resolves keys from one open handle of the root
        (local stores only)."""
        assert self._conf is not None
        return self._conf.held_root()

    @overload
    def open_inside(self, key: str, flags: int) -> int: ...
    @overload
    def open_inside(self, key: str, flags: int, *, with_stat: Literal[True]) -> tuple[int, os.stat_result]: ...
    def open_inside(self, key: str, flags: int, *, with_stat: bool = False) -> int | tuple[int, os.stat_result]:
        """Open the regular file ``key`` (local stores only) for ``os.open`` ``flags`` (no ``O_CREAT``),
        refusing symbolic links (the final file and every folder on the way), FIFOs and devices.

        Returns a file descriptor the caller closes; ``with_stat``: ``(fd, its fstat)``, the stat
        that showed it a regular file (so a caller needing its size asks the system once).

        Raises
        ------
        FileNotFoundError
            Nothing is at ``key`` (or a folder is).
        DamagedStoreError
            ``key`` leaves the store, is a link or a special file.
        """
        assert self._conf is not None
        return self._conf.open_stat(key, flags) if with_stat else self._conf.open(key, flags)

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

    def get_many(self, keys: list[str], *, limit: int | None = None, concurrency: int = GET_CONCURRENCY,
                 stats: dict[str, int] | None = None) -> list[bytes | None]:
        """``[self.get(key) for key in keys]``, with up to ``concurrency`` requests in flight at once
        on a non-local store (one event-loop round trip for the whole list), through the
        :class:`ChunkCache` when one is set.

        ``stats`` (optional) counts ``gets`` (requests), ``cache_hits`` and records ``in_flight_max``.
        """
        if self._conf is not None:
            return [self.get(key, limit=limit) for key in keys]
        for key in keys:
            check_key(key, self.url)
        cache = self.chunk_cache
        if cache is not None:
            found = [cache.get(self, key, limit) for key in keys]
            if stats is not None:
                stats["cache_hits"] = stats.get("cache_hits", 0) + sum(b is not None for b in found)
            todo = [k for k, b in zip(keys, found) if b is None]
            fetched = dict(zip(todo, self._get_many(todo, limit, concurrency, stats))) if todo else {}
            for key, data in fetched.items():
                if data is not None:
                    cache.put(self, key, data)
            return [b if b is not None else fetched[k] for k, b in zip(keys, found)]
        return self._get_many(keys, limit, concurrency, stats)

    def _get_many(self, keys: list[str], limit: int | None, concurrency: int,
                  stats: dict[str, int] | None) -> list[bytes | None]:
        proto = default_buffer_prototype()
        in_flight = [0]

        async def one(sem: asyncio.Semaphore, key: str) -> bytes | None:
            async with sem:
                in_flight[0] += 1
                if stats is not None:
                    stats["gets"] = stats.get("gets", 0) + 1
                    stats["in_flight_max"] = max(stats.get("in_flight_max", 0), in_flight[0])
                try:
                    buf = await self.zstore.get(key, prototype=proto)
                finally:
                    in_flight[0] -= 1
            if buf is None:
                return None
            cap = read_limit(key) if limit is None else limit
            if len(buf) > cap:
                raise DamagedStoreError(f"{self.url}: {key} holds {len(buf)} bytes; at most {cap} are expected there")
            return buf.to_bytes()

        async def every() -> list[bytes | None]:
            sem = asyncio.Semaphore(max(1, concurrency))
            return list(await asyncio.gather(*(one(sem, key) for key in keys)))

        return sync(every())

    def exists(self, key: str) -> bool:
        """A file (locally: anything but a folder, links included) is stored under ``key``."""
        if self._conf is not None:
            return self._conf.is_file(key)
        return bool(sync(self.zstore.exists(key)))

    def put(self, key: str, data: PutData, *, fsync: bool = False) -> None:
        """Write ``data`` under ``key`` atomically: readers see the old or the new bytes, never a mix.
        ``data``: bytes, or pieces of bytes and spans of open files (:mod:`.spans`).

        Locally: write a temp file, optionally ``fsync`` it, move it onto the key
        (:func:`trajstore.storage._replace.replace_file`: a link there is replaced, never written
        through), and (with ``fsync``) ``fsync`` the folder.
        Elsewhere: a single store ``set`` (one PUT).
        """
        self._check_writable()
        if self._conf is None:
            check_key(key, self.url)
            whole = data if isinstance(data, (bytes, bytearray)) else join_pieces(data)
            sync(self.zstore.set(key, default_buffer_prototype().buffer.from_bytes(whole)))
            return
        if self._put_beneath(key, data, fsync):
            return
        dest = self._conf.makedirs(key)
        self._write_and_move(key, data, fsync, self.new_tmp_path(), dest)
        if fsync:
            fsync_dir(dest.parent)

    def _put_beneath(self, key: str, data: PutData, fsync: bool) -> bool:
        """:meth:`put` through open fds of the key's folder and of the temp folder (each opened by
        openat2, which refuses links and leaving the store in one call), the temp file written and
        moved by name relative to them: no folder path is checked or walked again, and no
        ``mkdir`` is tried.  Measured, a commit record's put in a loop: 130-150 us against 170-240 us.

        Returns False, having written nothing, where it does not apply: no openat2, or either
        folder missing, a link or a file (the path-based :meth:`put` creates folders and says
        what is wrong).
        """
        assert self._conf is not None
        check_key(key, self.url)
        parent, _, name = key.rpartition("/")
        root = self._conf.folder_fd("")
        if root is None:
            return False
        folder: int | None = root
        tmp_folder: int | None = None
        try:
            folder = self._conf.folder_fd(parent, root) if parent else root
            tmp_folder = self._conf.folder_fd(TMP_DIR, root)
            if folder is None or tmp_folder is None:
                return False
            self._write_and_move(key, data, fsync, uuid.uuid4().hex, name, tmp_folder, folder)
            if fsync:
                os.fsync(folder)
            return True
        finally:
            for fd in {root, folder, tmp_folder}:
                if fd is not None:
                    os.close(fd)

    def _write_and_move(self, key: str, data: PutData, fsync: bool, tmp: str | Path, dest: str | Path,
                        tmp_dir_fd: int | None = None, dest_dir_fd: int | None = None) -> None:
        """Create the temp file ``tmp`` (never an existing name), write ``data`` (and ``fsync`` it),
        then move it onto ``dest`` (:func:`~trajstore.storage._replace.replace_file`); the names are
        relative to the folder fds where given.  On an error the temp file is removed and the old
        bytes stay under the key.

        Raises
        ------
        StoreFullError
            The filesystem is full.
        OSError
            Any other failure of the system calls.
        """
        assert self._conf is not None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o666, dir_fd=tmp_dir_fd)
            try:
                write_pieces(fd, [data] if isinstance(data, (bytes, bytearray)) else data)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            replace_file(tmp, dest, src_dir_fd=tmp_dir_fd, dst_dir_fd=dest_dir_fd)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=tmp_dir_fd)
            if isinstance(e, OSError):
                raise full_disk(e, self._conf.root / key, f"write {key}") from e
            raise  # (a span's file that ends early: ForeignFileError naming it)

    def new_tmp_path(self) -> Path:
        """A fresh temp file path inside the store (local stores only; create it with ``"xb"`` or
        ``O_EXCL``: the folder is checked to be a real folder of the store)."""
        assert self._conf is not None
        name = uuid.uuid4().hex
        folder = self._conf.root / TMP_DIR
        try:  # one lstat on every call (makedirs' cached checks and mkdir cost 40-100 us a commit)
            mode = os.lstat(folder).st_mode
        except FileNotFoundError:
            return self._conf.makedirs(f"{TMP_DIR}/{name}")
        if not stat.S_ISDIR(mode):  # (also a link put there while this writer runs)
            raise not_a_folder(str(self.url), TMP_DIR, mode)
        return folder / name

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

    def delete_prefix(self, prefix: str, *, keep_folder: bool = False) -> None:
        """Delete every key under ``prefix``.  Locally a link at ``prefix`` (or below) is unlinked,
        never followed: nothing outside the store is deleted; ``keep_folder`` leaves a real folder
        at ``prefix`` in place, empty."""
        self._check_writable()
        if self._conf is not None:
            self._conf.remove(prefix, keep_folder=keep_folder)
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

    def record_written(self, data: bytes) -> None:
        """The commit record ``data`` was just put: a transactional location commits here (one
        icechunk commit per trajstore commit); others have nothing to do."""
        if self.transaction is not None:
            self.transaction.record_written(data)

    def close(self) -> None:
        """Close the zarr store.  Errors are ignored (closing twice is harmless), except from a
        zip being written, whose close is what publishes the zip.  A transactional location's
        session drops what no commit named (and a local repository's writer lock is released)."""
        if self.transaction is not None:
            self.transaction.close()
        try:
            self.zstore.close()
        except Exception:  # closing a store twice or a store without close is harmless ...
            from trajstore.storage.zipstore import ZipWriter

            if isinstance(self.zstore, ZipWriter):
                raise  # ... but closing a zip being written is what publishes it



def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: storage_options keys that trajstore reads itself (ChunkCache, the version of an icechunk location);
#: never passed on to fsspec.
TRAJSTORE_OPTION_KEYS = ("trajstore_chunk_cache", "trajstore_chunk_cache_bytes", "trajstore_version",
                         "trajstore_checksums", "trajstore_ranges")


def fsspec_options(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` without trajstore's own keys: what fsspec (s3fs, gcsfs...) is given."""
    return {k: v for k, v in (storage_options or {}).items() if k not in TRAJSTORE_OPTION_KEYS}


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
    # A folder named *.zip is a folder store (below); anything else named *.zip is a zip file.
    if not _is_url(path) and path.endswith(".zip") and not os.path.isdir(path):
        if must_exist and not os.path.exists(path):
            raise StoreNotFoundError(f"no store at {path!r}: the file does not exist")
        # A zip is written once, start to end (dumps/copy), and read-only afterwards: it cannot
        # be updated in place.  So a writer never opens an existing zip (refused before the file
        # is touched), and a new zip is written beside the path and renamed onto it when done
        # (trajstore._zipstore: an existing zip is never truncated, a failed copy leaves it whole).
        from trajstore.storage.zipstore import (
            ZipReader,
            ZipWriter,
            check_zip_file,
            zip_read_only_error,
        )

        if read_only:
            check_zip_file(path)  # zipfile's "File is not a zip file" names neither the path nor the fix
            zstore: ZipStore = ZipReader(path, mode="r")  # reads bounded by what each entry claims
            sync(zstore._open())
        elif must_exist:
            check_zip_file(path)
            raise zip_read_only_error(path)
        else:
            zstore = ZipWriter(path)
        return Location(zstore, path, None)
    if path.startswith(("icechunk://", "icechunk+")):
        return _icechunk_location(path, read_only=read_only, storage_options=storage_options, must_exist=must_exist)
    if _is_url(path):
        opts = fsspec_options(storage_options)
        cache_folder = (storage_options or {}).get("trajstore_chunk_cache")
        cache_bytes = (storage_options or {}).get("trajstore_chunk_cache_bytes", 8 << 30)
        store = FsspecStore.from_url(path, storage_options=opts, read_only=read_only)
        loc = Location(store, path, None)
        if cache_folder is not None:
            loc.chunk_cache = ChunkCache(cache_folder, cache_bytes, path)
        if must_exist and not loc.exists("zarr.json"):
            raise StoreNotFoundError(f"no store at {path!r}: zarr.json not found")
        return loc
    root = Path(path).expanduser().absolute()
    _check_not_a_file(root)
    if must_exist and not root.exists():
        raise StoreNotFoundError(f"no store at {str(root)!r}: the folder does not exist")
    if not read_only:
        root.mkdir(parents=True, exist_ok=True)
    return Location(ConfinedLocalStore(root, read_only=read_only), str(root), root)


def _icechunk_location(url: str, *, read_only: bool, storage_options: dict[str, Any] | None,
                       must_exist: bool) -> Location:
    """A :class:`Location` inside an icechunk repository (storage/icechunk_location.py): a writer on
    its branch, a reader on one snapshot (``storage_options["trajstore_version"]``: a tag, a
    snapshot id or a datetime; default the branch's latest).  ``storage_options["trajstore_checksums"]``
    (readers): every key read must match the checksums recorded when the version was pushed;
    ``storage_options["trajstore_ranges"]`` (readers reading once, as a pull does): rows of raw
    chunks are fetched as byte ranges instead of whole chunks.

    Raises
    ------
    BadOptionError
        A version given to a writer (an old version is read-only), or an unknown scheme.
    StoreNotFoundError, NotATrajstoreError, VersionNotFoundError
        From :func:`~trajstore.storage.icechunk_location.open_repository` and ``resolve_version``.
    """
    from trajstore.errors import BadOptionError
    from trajstore.storage import icechunk_location as ic

    if not ic.is_icechunk_url(url):
        raise BadOptionError(f"{url!r}: unknown icechunk location; use icechunk://PATH or icechunk+s3://BUCKET/PREFIX")
    version = (storage_options or {}).get(ic.VERSION_OPTION)
    if version is not None and not read_only:
        raise BadOptionError(f"{url}: version {version!r} can only be opened read-only (read_only=True)")
    try:
        repo = ic.open_repository(url, fsspec_options(storage_options), create=not read_only and not must_exist)
    except StoreNotFoundError:
        if must_exist:
            raise
        # A reader of what need not exist (an fsspec URL's missing prefix lists nothing): nothing there.
        return Location(MemoryStore(read_only=True), url, None)
    tx = ic.IcechunkSession(repo, url, read_only=read_only,
                            version=None if version is None else ic.resolve_version(repo, url, version))
    loc = Location(tx.zstore, url, None)
    loc.transaction = tx
    if must_exist and not loc.exists("zarr.json"):
        loc.close()
        raise StoreNotFoundError(f"no store at {url!r}: the icechunk repository holds no zarr.json at its root")
    if read_only and (storage_options or {}).get("trajstore_checksums"):
        try:
            tx.require_checksums()  # every key read is checked against the checksums of its push
        except BaseException:
            loc.close()
            raise
    # A one-pass reader (pull) fetches rows of raw chunks as byte ranges (storage/fields/ranges.py).
    tx.ranged_reads = bool(read_only and (storage_options or {}).get("trajstore_ranges"))
    return loc


def _check_not_a_file(root: Path) -> None:
    """Refuse a local path that is, or lies under, something other than a folder.

    Without this, the OS answers with a bare ``[Errno 17]`` / ``[Errno 20]`` from ``mkdir`` or
    ``open`` deep inside zarr, naming neither the problem nor the fix.

    Raises
    ------
    NotATrajstoreError
        ``root`` (followed through links: the user's own path may be a link to a folder) or one
        of its parents exists and is not a folder.
    """
    for p in (root, *root.parents):
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there (yet): look at its parent
        except OSError:
            return  # unreadable: leave the error to the open itself
        if stat.S_ISDIR(st.st_mode):
            return
        kind = file_kind(st.st_mode)
        where = (f"{str(root)!r}: is a {kind}, not a trajstore store" if p == root else
                 f"{str(root)!r}: cannot be a trajstore store, its parent {str(p)!r} is a {kind}")
        raise NotATrajstoreError(f"{where} (a store is a folder, a .zip or a URL); pass the path of a store folder, "
                                 "or to create one a path that is not a file")


def open_zarr_group(loc: Location, *, mode: Literal["r", "r+", "a", "w", "w-"]) -> zarr.Group:
    """Open the root group, preferring consolidated metadata (one request on remote stores)."""
    return zarr.open_group(loc.zstore, mode=mode, use_consolidated=None if mode == "r" else False)
