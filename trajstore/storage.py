"""Where a store lives: resolving ``cache_path`` to a zarr store, and the key/value
operations the commit protocol needs (atomic put, rename, listing) on top of it.

A :class:`Location` wraps one zarr ``Store`` (``LocalStore``, ``FsspecStore``,
``MemoryStore`` or ``ZipStore``).  Local folders additionally expose ``local_root``
so that the fast paths (memory-mapped chunk files, ``os.replace``, ``fsync``,
``flock``) can bypass zarr-python; every other store goes through zarr's own API.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, MemoryStore, ZipStore

from .errors import ReadOnlyError, StoreNotFoundError

__all__ = ["Location", "resolve_location", "TMP_DIR", "STAGING_DIR"]

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
        """Filesystem path of ``key`` (local stores only)."""
        assert self.local_root is not None
        return self.local_root / key

    # -- key/value --------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """Bytes stored under ``key``, or ``None`` when it does not exist."""
        if self.local_root is not None:
            try:
                with open(self.local_root / key, "rb") as f:
                    return f.read()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                return None
        buf = sync(self.zstore.get(key, prototype=default_buffer_prototype()))
        return None if buf is None else buf.to_bytes()

    def exists(self, key: str) -> bool:
        if self.local_root is not None:
            return (self.local_root / key).exists()
        return bool(sync(self.zstore.exists(key)))

    def put(self, key: str, data: bytes, *, fsync: bool = False) -> None:
        """Write ``data`` under ``key`` atomically: readers see the old or the new bytes, never a mix.

        Locally: write a temp file, optionally ``fsync`` it, ``os.replace`` it onto the key, and
        (with ``fsync``) ``fsync`` the folder.  Elsewhere: a single store ``set`` (one PUT).
        """
        self._check_writable()
        if self.local_root is None:
            sync(self.zstore.set(key, default_buffer_prototype().buffer.from_bytes(data)))
            return
        dest = self.local_root / key
        tmp = self.new_tmp_path()
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
        if fsync:
            fsync_dir(dest.parent)

    def new_tmp_path(self) -> Path:
        """A fresh temp file path inside the store (local stores only)."""
        assert self.local_root is not None
        tmp_dir = self.local_root / TMP_DIR
        tmp_dir.mkdir(exist_ok=True)
        return tmp_dir / uuid.uuid4().hex

    def delete(self, key: str) -> None:
        self._check_writable()
        if self.local_root is not None:
            try:
                (self.local_root / key).unlink()
            except FileNotFoundError:
                pass
            return
        sync(self.zstore.delete(key))

    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` onto ``dst`` (atomic locally; a copy then delete elsewhere)."""
        self._check_writable()
        if self.local_root is not None:
            dest = self.local_root / dst
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.local_root / src, dest)
            return
        data = self.get(src)
        if data is None:
            raise FileNotFoundError(src)
        self.put(dst, data)
        self.delete(src)

    def list_prefix(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (a folder name without trailing slash; ``""`` for all)."""
        if self.local_root is not None:
            base = self.local_root / prefix if prefix else self.local_root
            if not base.exists():
                return []
            out = []
            for dirpath, _dirs, files in os.walk(base):
                for name in files:
                    out.append(os.path.relpath(os.path.join(dirpath, name), self.local_root).replace(os.sep, "/"))
            return sorted(out)
        pre = prefix + "/" if prefix else ""

        async def _collect() -> list[str]:
            return [k async for k in self.zstore.list_prefix(pre)]

        return sorted(sync(_collect()))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""
        self._check_writable()
        if self.local_root is not None:
            shutil.rmtree(self.local_root / prefix, ignore_errors=True)
            return
        for key in self.list_prefix(prefix):
            self.delete(key)

    def iter_sizes(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """``(key, nbytes)`` for every key under ``prefix``; locally the bytes the file occupies on
        disk (raw chunk files are created sparse and only hold the pages written)."""
        if self.local_root is not None:
            for key in self.list_prefix(prefix):
                st = (self.local_root / key).stat()
                yield key, min(st.st_size, st.st_blocks * 512)
            return
        for key in self.list_prefix(prefix):
            yield key, int(sync(self.zstore.getsize(key)))

    def close(self) -> None:
        try:
            self.zstore.close()
        except Exception:  # closing a store twice or a store without close is harmless
            pass


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
        # A zip is written once, start to end (dumps/copy); it cannot be updated in place.
        zstore = ZipStore(path, mode="r" if read_only else "w")
        sync(zstore._open())
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
    if not read_only:
        root.mkdir(parents=True, exist_ok=True)
    return Location(LocalStore(root, read_only=read_only), str(root), root)


def open_zarr_group(loc: Location, *, mode: str) -> zarr.Group:
    """Open the root group, preferring consolidated metadata (one request on remote stores)."""
    return zarr.open_group(loc.zstore, mode=mode, use_consolidated=None if mode == "r" else False)
