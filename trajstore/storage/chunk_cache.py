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

from trajstore.errors import BadOptionError
from trajstore.storage.confined import read_limit
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
        self.root = Path(folder).expanduser().absolute() / hashlib.sha1(url.encode()).hexdigest()[:20]
        self.max_bytes = max_bytes
        self._tag: str | None = None
        self._total: int | None = None

    def invalidate(self) -> None:
        """The commit record may have changed: the next read fetches it again to find its entries."""
        self._tag = None

    def _dir(self, loc: Location) -> Path:
        if self._tag is None:
            head = loc.get(HEAD_KEY)  # bounded like every read of the record
            self._tag = hashlib.sha1(b"" if head is None else head).hexdigest()[:20]
        return self.root / self._tag

    def get(self, loc: Location, key: str, limit: int | None) -> bytes | None:
        """The cached bytes of ``key`` under ``loc``'s current commit record, or None (not cached,
        unreadable, or more than ``limit`` bytes: the key's read limit when None).  A hit
        refreshes the entry's modification time, so it is evicted last."""
        p = self._dir(loc) / key
        try:
            with open(p, "rb") as f:
                data = f.read((read_limit(key) if limit is None else limit) + 1)
            os.utime(p)
        except OSError:
            return None
        return None if len(data) > (read_limit(key) if limit is None else limit) else data

    def put(self, loc: Location, key: str, data: bytes) -> None:
        """Cache ``data`` as ``key`` under ``loc``'s current commit record (atomically, by rename).
        Once the folder holds more than ``max_bytes``, the oldest entries are deleted down to
        three quarters of it.  Data larger than ``max_bytes`` is not cached; a full or read-only
        cache folder only costs the cache."""
        if len(data) > self.max_bytes:
            return
        p = self._dir(loc) / key
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, p)
        except OSError:  # a full or read-only cache folder only costs the cache
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
