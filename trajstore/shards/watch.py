"""Which shards' commit records may have changed, for one system call per batch (Linux inotify).

A single local store checks its commit record before every read with one ``stat``
(:class:`trajstore.storage.head.HeadWatch`).  Over S shards that is S ``stat`` calls per batch,
and as many again for the check after the read.  :class:`ShardWatch` keeps one inotify
instance watching every shard's folder: a commit replaces the shard's record by a rename into
that folder, and the kernel queues the event inside the rename call, so one non-blocking
``read`` of the queue names every shard whose record was replaced since the last look.  Only
those shards are then checked (with their own ``stat``), so the staleness bound is the single
store's: a read sees every commit finished before it started.

inotify sees only changes made through this machine's kernel, so it is used only on local
filesystems (:data:`LOCAL_FS`, from ``/proc/self/mountinfo``); a shard on NFS, a FUSE mount, an
unknown filesystem or a URL is not watched and is checked with ``stat`` / a record read before
every read, as before.  Where inotify is missing (not Linux, no free instance), nothing is watched.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
import time
from typing import Any

from trajstore.storage.mounts import fs_type, mounts

__all__ = ["LOCAL_FS", "SWEEP_INTERVAL_S", "WATCH_MIN_SHARDS", "CommitChecks", "ShardWatch"]

#: Filesystem types whose every change goes through the local kernel (inotify sees them all).
LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "zfs", "overlay", "jfs", "reiserfs"})

_IN_NONBLOCK, _IN_CLOEXEC = 0o4000, 0o2000000
# Anything that can replace or remove the record file, or the folder itself.
_MASK = (0x00000008 | 0x00000040 | 0x00000080 | 0x00000100 | 0x00000200 | 0x00000400 | 0x00000800
         | 0x00000004)  # CLOSE_WRITE, MOVED_FROM, MOVED_TO, CREATE, DELETE, DELETE_SELF, MOVE_SELF, ATTRIB
_IN_Q_OVERFLOW, _IN_IGNORED = 0x00004000, 0x00008000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_READ_BYTES = 64 * 1024
_MAX_READS = 16

#: Watched shards' records are also all checked at least this often (seconds), a safety net
#: for an event the watch could not see (it is exact on the filesystems it accepts).
SWEEP_INTERVAL_S = 1.0
#: Datasets of fewer shards check every shard's record by ``stat`` (a few calls a batch) and use
#: no inotify instance (a user has 128 by default, shared by all their processes).
WATCH_MIN_SHARDS = 4

_libc: Any = None


def _inotify() -> Any:
    global _libc
    if _libc is None:
        if not sys.platform.startswith("linux"):
            _libc = False
        else:
            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.inotify_init1.argtypes = [ctypes.c_int]
                lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
                _libc = lib
            except (OSError, AttributeError):
                _libc = False
    return _libc


class ShardWatch:
    """One inotify instance over the folders of the shards' commit records.

    :meth:`add` watches a folder and returns True, or False when it cannot be watched exactly (not a
    local filesystem, no inotify): the caller then checks that shard before every read.
    :meth:`changed` returns the keys of the folders that had an event since the last call, or None
    when events were lost (queue overflow) and every shard must be checked.  Owned by the process
    that made it: after a fork the child's copy watches nothing (:attr:`usable` is False).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._fd = -1
        self._keys: dict[int, Any] = {}
        #: Keys whose watch ended (the folder was removed or moved): the caller stats them instead.
        self.lost: set[Any] = set()
        self._mounts: list[tuple[str, str]] | None = None
        lib = _inotify()
        if lib:
            fd = lib.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd >= 0:  # EMFILE (max_user_instances reached): stat every shard instead
                self._fd = fd

    @property
    def forked(self) -> bool:
        """Whether this is a forked child's copy (the parent's queue: never read it here)."""
        return self._pid != os.getpid()

    @property
    def usable(self) -> bool:
        """Whether this process's watch is open (not closed, not inherited through a fork)."""
        return self._fd >= 0 and self._pid == os.getpid()

    def add(self, folder: str, key: Any) -> bool:
        """Watch ``folder`` (a shard's root, holding its commit record) under ``key``."""
        if not self.usable:
            return False
        if self._mounts is None:
            self._mounts = mounts()
        if fs_type(folder, self._mounts) not in LOCAL_FS:
            return False
        wd = _libc.inotify_add_watch(self._fd, os.fsencode(folder), _MASK)
        if wd < 0:  # ENOSPC (max_user_watches), ENOENT, EACCES: check this shard by stat
            return False
        self._keys[wd] = key
        return True

    def changed(self) -> set[Any] | None:
        """Keys of watched folders with events since the last call; None after lost events."""
        out: set[Any] = set()
        for _ in range(_MAX_READS):  # bounded: writers flooding a folder with events cannot hold a reader here
            try:
                raw = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return out
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                return None
            pos = 0
            while pos + _EVENT.size <= len(raw):
                wd, mask, _cookie, n = _EVENT.unpack_from(raw, pos)
                pos += _EVENT.size + n
                if mask & _IN_Q_OVERFLOW:
                    self._drain()
                    return None
                key = self._keys.get(wd)
                if key is not None:
                    out.add(key)
                if mask & _IN_IGNORED and key is not None:  # the folder is gone: stat it from now on
                    del self._keys[wd]
                    self.lost.add(key)
            if len(raw) < _READ_BYTES - 4096:
                return out
        return None  # more events than a check reads: every shard is checked instead

    def _drain(self) -> None:
        for _ in range(_MAX_READS):  # what is left is read (and answered with None) next time
            try:
                if not os.read(self._fd, _READ_BYTES):
                    return
            except OSError:
                return

    def close(self) -> None:
        """Stop watching (a forked child closes only its own copy of the descriptor)."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self._keys = {}

    def __del__(self) -> None:
        self.close()


class CommitChecks:
    """Which shards' commit records a reader of a sharded dataset checks before and after a read:
    watched shards only when their folder had an event (:attr:`dirty`), the others
    (:attr:`unwatched`: not a local filesystem, a URL, no inotify, too few shards) every time.

    :meth:`update` is told every shard (name, folder of its record or None) whenever the shards
    change; :meth:`due` answers with the names to check now.
    """

    def __init__(self) -> None:
        self.watch: ShardWatch | None = None  # made once there are WATCH_MIN_SHARDS shards
        self.dirty: set[str] = set()
        self.unwatched: set[str] = set()
        self._folders: dict[str, str | None] = {}
        self._swept = time.monotonic()

    def update(self, shards: list[tuple[str, str | None]]) -> None:
        """The shards now open: ``(name, folder holding its commit record, or None for a URL)``."""
        new = [(n, f) for n, f in shards if n not in self._folders]
        self._folders.update(new)
        if self.watch is None and len(self._folders) >= WATCH_MIN_SHARDS:
            self._rewatch()
        else:
            for n, f in new:
                self._add(n, f)

    def _add(self, name: str, folder: str | None) -> None:
        if folder is not None and self.watch is not None and self.watch.add(folder, name):
            self.dirty.add(name)  # a commit between its open and the watch: check it once
        else:
            self.unwatched.add(name)

    def _rewatch(self) -> None:
        """A new watch over every shard (each checked once at the next read)."""
        if self.watch is not None:
            self.watch.close()
        self.watch, self.dirty, self.unwatched = ShardWatch(), set(), set()
        for n, f in self._folders.items():
            self._add(n, f)

    def due(self, names: list[str], touched: set[str] | None = None) -> set[str]:
        """Names of the shards whose record may have changed, among ``touched`` when given (the
        others stay marked for the next call); ``names``: every shard now."""
        if self.watch is not None and self.watch.forked:  # a forked child: its own watch
            self._rewatch()
        w = self.watch
        seen = w.changed() if w is not None and w.usable else set()
        now = time.monotonic()
        if seen is None or now - self._swept >= SWEEP_INTERVAL_S:
            self._swept = now
            self.dirty.update(names)
        else:
            self.dirty |= seen
        if w is not None and w.lost:
            self.unwatched |= w.lost
            w.lost.clear()
        if touched is None:
            out, self.dirty = self.dirty, set()
            return out | self.unwatched
        out = touched & self.dirty
        self.dirty -= out
        return out | (touched & self.unwatched)

    def close(self) -> None:
        """Stop watching."""
        if self.watch is not None:
            self.watch.close()
