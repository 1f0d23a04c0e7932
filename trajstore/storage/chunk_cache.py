"""``ChunkCache``: a bounded local folder of a remote store's encoded chunks, for stores read
many times (opted into through ``storage_options``; :func:`trajstore.storage.location.resolve_location`
sets it on the store's :class:`~trajstore.storage.location.Location`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from trajstore.errors import BadOptionError, DamagedStoreError
from trajstore.storage.confined import Confinement, read_limit
from trajstore.storage.keys import HEAD_KEY

if TYPE_CHECKING:
    from trajstore.storage.location import Location

__all__ = ["ChunkCache"]


class ChunkCache:
    """A bounded folder of encoded chunks of one remote store, for stores read many times.

    Opt in with ``storage_options={"trajstore_chunk_cache": "/local/folder"}`` (and optionally
    ``"trajstore_chunk_cache_bytes": N``, default 8 GiB); the two keys are taken out before the
    options reach fsspec.  Only the chunk reads of compressed fields go through it.

    Entries live under ``<folder>/<hash of the URL>/<hash of the commit record>/<chunk key>``: a
    store whose commit record changed (a new commit, a rewrite) never reads entries written under an
    older record; :meth:`invalidate` (called when a reader adopts a new commit) makes the next read
    fetch the record again (one small GET).  Files are written to a temp name and renamed, so
    several processes may share the folder; the oldest files (by modification time, refreshed on
    every hit) are deleted once the folder holds more than ``max_bytes``.
    """

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int, url: str) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise BadOptionError(f"trajstore_chunk_cache_bytes must be a non-negative int; got {max_bytes!r}")
        folder = Path(folder).expanduser().absolute()
        self._prefix = hashlib.sha1(url.encode()).hexdigest()[:20]
        self.root = folder / self._prefix
        # Everything below the folder the user named is reached without following a link, and
        # only regular files are read (a FIFO planted as an entry would block a plain open).
        self._conf = Confinement(folder, f"chunk cache {folder}")
        self.max_bytes = max_bytes
        self._tag: str | None = None
        self._total: int | None = None

    def invalidate(self) -> None:
        """The commit record may have changed: the next read fetches it again to find its entries."""
        self._tag = None

    def _key(self, loc: Location, key: str) -> str:
        """``key``'s entry below the cache folder: ``<URL hash>/<commit record hash>/<key>``."""
        if self._tag is None:
            head = loc.get(HEAD_KEY)  # bounded like every read of the record
            self._tag = hashlib.sha1(b"" if head is None else head).hexdigest()[:20]
        return f"{self._prefix}/{self._tag}/{key}"

    def get(self, loc: Location, key: str, limit: int | None) -> bytes | None:
        """The cached bytes of ``key`` under ``loc``'s current commit record, or None (not cached,
        unreadable, not a regular file, reached through a link, or more than ``limit`` bytes: the
        key's read limit when None).  A hit refreshes the entry's modification time, so it is
        evicted last."""
        entry = self._key(loc, key)
        try:
            data = self._conf.read(entry, read_limit(key) if limit is None else limit)
        except (DamagedStoreError, OSError):
            return None
        if data is not None:
            with contextlib.suppress(OSError, NotImplementedError):
                os.utime(self._conf.root / entry, follow_symlinks=False)
        return data

    def put(self, loc: Location, key: str, data: bytes) -> None:
        """Cache ``data`` as ``key`` under ``loc``'s current commit record (atomically, by rename).
        Once the folder holds more than ``max_bytes``, the oldest entries are deleted down to
        three quarters of it.  Data larger than ``max_bytes`` is not cached; a full or read-only
        cache folder, or a link where one of its folders belongs, only costs the cache."""
        if len(data) > self.max_bytes:
            return
        try:
            p = self._conf.makedirs(self._key(loc, key))
            tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "xb") as f:  # exclusive: never opens what stands there already
                f.write(data)
            os.replace(tmp, p)
        except (DamagedStoreError, OSError):  # a full or read-only cache folder only costs the cache
            return
        if self._total is None:
            self._total = sum(sz for _p, sz, _t in self._files())
        else:
            self._total += len(data)
        if self._total > self.max_bytes:
            self._evict()

    def _files(self) -> list[tuple[Path, int, float]]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                q = Path(dirpath) / name
                try:
                    st = os.lstat(q)
                except OSError:
                    continue
                out.append((q, st.st_size, st.st_mtime))
        return out

    def _evict(self) -> None:
        files = sorted(self._files(), key=lambda e: e[2])
        total = sum(sz for _p, sz, _t in files)
        for q, sz, _t in files:
            if total <= self.max_bytes * 3 // 4:  # some slack: a walk per eviction, not per put
                break
            with contextlib.suppress(OSError):
                q.unlink()
                total -= sz
        self._total = total
