"""Linked video segments: an episode's packets read in place from a *pack*, a file the store shares
with a source through a hard link made at import (docs/format.md "Linked segments").

A linked import (:func:`trajstore.interop.import_lerobot` with ``link=True``) hard-links each
source MP4 into the store as ``<field>/video/pack/<k>`` (:func:`link_pack`) and writes each
episode's segment ``<field>/video/<lo>`` as a *linked segment* naming the packets' bytes in that
pack instead of holding them:

- the magic ``TSVLNK01``; four u64: the pack number ``k``, the packets' byte range ``[a, b)`` in
  the pack, the crc32c of those bytes; the ``(offset, size, keyframe)`` u64 triples (offsets into
  the pack, inside ``[a, b)``), the frame count (u64) and the crc32c of everything after the magic.

A linked segment's packets are read with ``pread`` through the store's confined open (a pack is a
regular file inside the store: a link or special file is refused), never mapped: a pack truncated
in place (the source MP4 edited) is a short read, a :class:`~trajstore.errors.DamagedStoreError`,
never a SIGBUS.  Opening one (:func:`open_linked`) checks the pack holds ``[a, b)`` and, unless
told not to, the crc32c of those bytes, read in bounded blocks; a GOP's packets are then read
one GOP at a time (:meth:`LinkedSegment.packets`), each read comparing the pack's ``fstat`` with
the one of the last check and checking the bytes again when it moved (a source edited in place
while a reader holds the segment: :class:`LinkedSegment`).  Copies write a linked segment as a plain one
(:meth:`LinkedSegment.keyframe_flags` and the packets), so a copy holds no pack.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import google_crc32c
import numpy as np

from trajstore.errors import DamagedStoreError, ForeignFileError
from trajstore.storage.confined import MAX_FILE_BYTES, pread
from trajstore.storage.location import Location

__all__ = ["LINK_MAGIC", "MAX_PACKS", "SETTLE_NS", "LinkedSegment", "Stamp", "checks_done", "crc_of_range",
           "is_pack_key", "link_pack", "linked_segment", "open_linked", "pack_key"]

LINK_MAGIC = b"TSVLNK01"
#: Packs one field may have (a pack number at or above it is damage).
MAX_PACKS = 1 << 20
#: Bytes read per ``pread`` when a range is checksummed or read.
BLOCK = 1 << 20
_HEAD = struct.Struct("<QQQQ")  # pack, a, b, crc32c of [a, b)
_PACK = re.compile(r"^(.+)/video/pack/(0|[1-9][0-9]{0,9})$")
#: ``linkat`` failures that mean "no link here": the import copies the packets instead.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EACCES, errno.ENOENT, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
            errno.ENOSYS, errno.EROFS}


def pack_key(array_path: str, k: int) -> str:
    """Key of pack ``k`` of the video field ``array_path``."""
    return f"{array_path}/video/pack/{k}"


def is_pack_key(key: str) -> bool:
    """Whether ``key`` is named as a pack (``<field>/video/pack/<k>``)."""
    return _PACK.match(key) is not None


def _crc(b: bytes) -> int:
    return int(google_crc32c.value(b))


def linked_segment(pack: int, a: int, b: int, crc: int, offsets: np.ndarray, sizes: np.ndarray,
                   keyframes: np.ndarray) -> bytes:
    """The bytes of a linked segment: packets at ``offsets`` (n,) of ``sizes`` (n,) bytes in pack
    ``pack`` (offsets into the pack, all inside ``[a, b)``, whose crc32c is ``crc``), ``keyframes`` (n,) bool."""
    table = np.zeros((len(sizes), 3), "<u8")
    table[:, 0], table[:, 1], table[:, 2] = offsets, sizes, np.asarray(keyframes, bool)
    body = _HEAD.pack(pack, a, b, crc) + table.tobytes() + struct.pack("<Q", len(sizes))
    return LINK_MAGIC + body + _crc(body).to_bytes(4, "little")


def _pread_all(fd: int, lo: int, hi: int, key: str, need: int) -> bytes:
    """Bytes ``[lo, hi)`` of the open pack ``fd`` (``key``, which must hold ``need`` bytes): a
    short read is a ValueError."""
    parts, pos = [], lo
    while pos < hi:
        got = pread(fd, min(BLOCK << 4, hi - pos), pos)
        if not got:
            raise ValueError(f"its pack {key} ends at byte {pos}; the segment needs {need}")
        parts.append(got)
        pos += len(got)
    return b"".join(parts)


def _read(loc: Location, key: str, lo: int, hi: int, need: int) -> bytes:
    """Bytes ``[lo, hi)`` of the pack ``key``, once the pack is seen to hold at least ``need``
    bytes; ValueError naming what is wrong (missing, too short, a short read)."""
    if loc.is_local:
        try:
            fd, st = loc.open_inside(key, os.O_RDONLY, with_stat=True)
        except FileNotFoundError:
            raise ValueError(f"its pack {key} is missing") from None
        try:
            if st.st_size < need:
                raise ValueError(f"its pack {key} holds {st.st_size} bytes; the segment needs {need} (the source "
                                 "file was truncated or replaced)")
            return _pread_all(fd, lo, hi, key, need)
        finally:
            os.close(fd)
    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    if lo == hi:  # only the size asked about
        try:
            size = int(sync(loc.zstore.getsize(key)))
        except FileNotFoundError:
            raise ValueError(f"its pack {key} is missing") from None
        if size < need:
            raise ValueError(f"its pack {key} holds {size} bytes; the segment needs {need}")
        return b""
    got = sync(loc.zstore.get(key, prototype=default_buffer_prototype(), byte_range=RangeByteRequest(lo, hi)))
    if got is None:
        raise ValueError(f"its pack {key} is missing")
    if len(got) != hi - lo:
        raise ValueError(f"its pack {key} ends before byte {hi}; the segment needs {need}")
    return bytes(got.to_bytes())


def crc_of_range(fd: int, a: int, b: int, where: str) -> int:
    """The crc32c of bytes ``[a, b)`` of the open file ``fd``, read in blocks of :data:`BLOCK`
    (a source MP4 that ends before ``b``: ForeignFileError naming ``where``)."""
    crc, pos = 0, a
    while pos < b:
        got = pread(fd, min(BLOCK, b - pos), pos)
        if not got:
            raise ForeignFileError(f"{where}: the file ends at byte {pos}, before the packets its index names (to {b})")
        crc = int(google_crc32c.extend(crc, got))
        pos += len(got)
    return crc


#: A pack as an ``fstat`` shows it: ``(st_size, st_mtime_ns, st_ctime_ns, st_ino, st_dev)``.
Stamp = tuple[int, int, int, int, int]
#: A stamp is trusted (no checksum pass while the pack's ``fstat`` still shows it) only when the
#: pack's last change (its ctime) was at least this long before the stamp was taken: a write in
#: the same timestamp tick (the kernel's coarse clock, a few ms) as the change before it may
#: leave every field of the stamp as it was.  Until then each read checks the bytes again.
SETTLE_NS = 1_000_000_000
_checks = [0]
_checks_lock = threading.Lock()


def checks_done() -> int:
    """Checksum passes over a linked segment's ``[a, b)`` this process has made (first opens and
    checks again after a pack's ``fstat`` changed): what a test counts."""
    return _checks[0]


def _stamp(st: os.stat_result) -> Stamp:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


class LinkedSegment:
    """A checked linked segment: per frame ``offsets`` (into the pack) and ``sizes`` (int64),
    ``keys`` (int64 positions of the keyframes, the first 0); the packets are read from pack
    ``pack_key`` of ``loc`` when asked for (``where`` names the field and rows in errors).

    A local pack is opened through the store's confined open for each read, and the ``fstat``
    taken there is compared with the :data:`Stamp` of the pack when its bytes last matched their
    crc32c (``stamp``): the same, the GOP's bytes are read with ``pread`` and the pack's
    ``fstat`` is compared once more after the read (a write during it); different (or no trusted
    stamp: :data:`SETTLE_NS`), ``[a, b)`` is read and checked again and the GOP served from those
    very bytes.  So every write to the pack after the check -- ``write``, ``pwrite``,
    ``truncate``, ``fallocate``, ``utime`` (any of them changes the ctime, even a rewrite that
    keeps size and mtime), a file renamed over the pack's name (its inode) -- makes the next read
    check the bytes: a change is a DamagedStoreError naming the field and rows, a change that
    leaves the bytes as they were (a ``touch``) costs a checksum pass per read until it is
    :data:`SETTLE_NS` old, then one more.  Not seen: writes through
    a shared writable mapping to pages already dirty when the stamp was taken (the kernel updates
    the times at a page's first write fault only), a filesystem whose times do not move (some
    network or FUSE filesystems, a clock set back past the stamp) and a pack on a non-local store
    (its size only is checked per read: objects there are replaced whole, not edited).  Nothing
    decoded is kept between reads (a video field caches segments, never frames), so no frame of a
    changed pack is ever served from memory.  The stamp is a plain attribute: threads reading one
    segment at once may both check the bytes again (the same answer), and a forked worker keeps
    its parent's stamp and compares it with its own ``fstat``; no descriptor is held between
    reads.
    """

    __slots__ = ("a", "b", "crc", "flags", "keys", "loc", "offsets", "pack_key", "sizes", "stamp", "where")

    def __init__(self, loc: Location, pack: str, head: tuple[int, int, int], table: np.ndarray, where: str):
        self.loc, self.pack_key, self.where = loc, pack, where
        self.a, self.b, self.crc = head
        self.offsets, self.sizes = table[:, 0].astype(np.int64), table[:, 1].astype(np.int64)
        self.flags = table[:, 2].astype(bool)
        self.keys = np.flatnonzero(self.flags).astype(np.int64)
        self.stamp: Stamp | None = None  # the pack when ``[a, b)`` last matched ``crc`` (None: check first)

    def check_bytes(self) -> None:
        """Read ``[a, b)`` of the pack in blocks and compare its crc32c (DamagedStoreError naming
        the field and rows: the source file was edited in place after the import)."""
        self._bytes(self.a, self.a, check=True)

    def _bytes(self, lo: int, hi: int, check: bool = False) -> bytes:
        """Bytes ``[lo, hi)`` of the pack (inside ``[a, b)``); ``check``: ``[a, b)`` checked first."""
        try:
            if self.loc.is_local:
                return self._local(lo, hi, check)
            if check:  # (lo == hi) where the segment is opened
                return self._verify(lambda pos, end: _read(self.loc, self.pack_key, pos, end, self.b), None, lo, hi)
            return _read(self.loc, self.pack_key, lo, hi, self.b)
        except (ValueError, DamagedStoreError) as e:  # (the confined open refusing a link or special file)
            raise DamagedStoreError(f"{self.where}: {e}") from None

    def _local(self, lo: int, hi: int, check: bool) -> bytes:
        try:
            fd, st = self.loc.open_inside(self.pack_key, os.O_RDONLY, with_stat=True)
        except FileNotFoundError:
            raise ValueError(f"its pack {self.pack_key} is missing") from None
        try:
            stamp = self.stamp
            if not check and stamp is not None and _stamp(st) == stamp:
                got = _pread_all(fd, lo, hi, self.pack_key, self.b)
                if _stamp(os.fstat(fd)) == stamp:  # (no write during the read either)
                    return got
            now = time.time_ns()  # (before the fstat: the stamp's age is never overstated)
            stamp = _stamp(os.fstat(fd))
            got = self._verify(lambda pos, end: _pread_all(fd, pos, end, self.pack_key, self.b), stamp, lo, hi)
            self.stamp = stamp if _stamp(os.fstat(fd)) == stamp and now - stamp[2] >= SETTLE_NS else None
            return got
        finally:
            os.close(fd)

    def _verify(self, read: Callable[[int, int], bytes], stamp: Stamp | None, lo: int, hi: int) -> bytes:
        """Read ``[a, b)`` with ``read(pos, end)`` in blocks, compare its crc32c, and return the
        bytes ``[lo, hi)`` of what was read (ValueError: short, or not matching)."""
        if stamp is not None and stamp[0] < self.b:
            raise ValueError(f"its pack {self.pack_key} holds {stamp[0]} bytes; the segment needs {self.b} (the "
                             "source file was truncated or replaced)")
        with _checks_lock:
            _checks[0] += 1
        crc, pos, keep = 0, self.a, []
        while pos < self.b:
            end = min(pos + (BLOCK << 4), self.b)
            got = read(pos, end)
            crc = int(google_crc32c.extend(crc, got))
            if lo < end and hi > pos:
                keep.append(got[max(lo, pos) - pos : min(hi, end) - pos])
            pos = end
        if crc != self.crc:
            raise ValueError(f"the packets in {self.pack_key} [{self.a}, {self.b}) do not match their checksum (the "
                             "file the store shares with its import source was changed in place)")
        return b"".join(keep)

    def packets(self, i: int, j: int) -> list[np.ndarray]:
        """The packets of frames ``[i, j)``, read from the pack with one ``pread`` of their span."""
        if j <= i:
            return []
        off, size = self.offsets[i:j], self.sizes[i:j]
        lo, hi = int(off.min()), int((off + size).max())
        buf = np.frombuffer(self._bytes(lo, hi), np.uint8)
        return [buf[o - lo : o - lo + s] for o, s in zip(off.tolist(), size.tolist())]

    def keyframe_flags(self) -> list[bool]:
        """Each frame's keyframe flag (a copy writes the segment as a plain one with them)."""
        return [bool(f) for f in self.flags]


def open_linked(loc: Location, array_path: str, buf: np.ndarray, rows: int, where: str,
                check_bytes: bool = True, limit: int = MAX_FILE_BYTES) -> LinkedSegment:
    """The linked segment ``buf`` (uint8: its file's bytes) of field ``array_path``, holding the
    ``rows`` frames the index gives it; its pack holds ``[a, b)`` and (``check_bytes``) those
    bytes match their crc32c.  ``[a, b)`` may hold at most ``limit`` bytes (what a plain segment
    of those rows may: a hostile pack, sparse and huge, never makes a read allocate more).

    Raises ValueError naming what is wrong in the segment itself (magic, size, checksum, count, a
    pack number or byte range out of range, a packet outside ``[a, b)``, a first frame that is no
    keyframe);
    DamagedStoreError naming ``where`` for its pack (missing, a link or special file, shorter
    than ``b``, bytes that do not match)."""
    n = len(buf)
    if n != 8 + _HEAD.size + 24 * rows + 12 or buf[:8].tobytes() != LINK_MAGIC:
        raise ValueError(f"{n} bytes are no linked segment of {rows} frames (magic or size)")
    body = buf[8 : n - 4].tobytes()
    if _crc(body).to_bytes(4, "little") != buf[n - 4 :].tobytes():
        raise ValueError("the linked segment's checksum does not match")
    pack, a, b, crc = _HEAD.unpack(body[: _HEAD.size])
    count = struct.unpack("<Q", body[-8:])[0]
    if count != rows:
        raise ValueError(f"the segment holds {count} frames; the index gives it {rows}")
    if pack >= MAX_PACKS or not a <= b <= a + limit:
        raise ValueError(f"pack number {pack} or byte range [{a}, {b}) out of range (packs 0..{MAX_PACKS - 1}, at "
                         f"most {limit} bytes)")
    table = np.frombuffer(body[_HEAD.size : -8], "<u8").reshape(rows, 3)
    off, size, key = table[:, 0], table[:, 1], table[:, 2]
    bad = (off < a) | (off > b) | (size == 0) | (size > np.uint64(b) - np.minimum(off, np.uint64(b))) | (key > 1)
    if bad.any():
        raise ValueError(f"the frame table places frame {int(np.flatnonzero(bad)[0])} outside bytes [{a}, {b}) of "
                         "its pack")
    if rows and not key[0]:
        raise ValueError("the segment's first frame is not a keyframe")
    seg = LinkedSegment(loc, pack_key(array_path, pack), (a, b, crc), table, where)
    try:
        if check_bytes:
            seg.check_bytes()
        else:
            _read(loc, seg.pack_key, 0, 0, b)  # exists, a regular file inside the store, holding [a, b)
    except ValueError as e:
        raise DamagedStoreError(f"{where}: {e}") from None
    return seg


def _link(fd: int, path: str | None, dest: Any) -> str:
    """Hard-link the open file ``fd`` as ``dest``: ``linkat`` of ``/proc/self/fd/N`` following it;
    where that is refused (no ``/proc``; a sandbox's ``/proc`` on its own device) and ``path``
    names the file, ``linkat`` of ``path`` (not following a link: the caller compares the inode
    linked with ``fd``'s).  Returns "" once linked, else why not."""
    why = ""
    for src, follow in ((f"/proc/self/fd/{fd}", True), (path, False)):
        if src is None:
            continue
        try:
            os.link(src, dest, follow_symlinks=follow)
            return ""
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
            why = f"{errno.errorcode.get(e.errno or 0, e.errno)} ({e.strerror})"
    return why


def link_pack(loc: Location, key: str, fileobj: Any, path: str | None = None) -> str:
    """Hard-link the open file ``fileobj`` (the one the foreign gate opened and checked) into the
    local store ``loc`` as ``key``: ``linkat`` of ``/proc/self/fd/N`` following it, so the file
    linked is that open file, else (that refused) of ``path``, the name it was opened by; then the
    ``fstat`` of the open file and of the link, opened through the store's confined open, are
    compared (same device and inode: the file linked is the one opened, whatever happened to
    ``path`` meanwhile).

    Returns "" once linked, or why no link was made (another filesystem, a refusal, no
    ``/proc``, a file replaced at ``path`` since it was opened): the caller copies the packets
    instead.
    """
    fd = fileobj.fileno()
    dest = loc.path(key)
    os.makedirs(dest.parent, exist_ok=True)
    why = _link(fd, path, dest)
    if not why:
        src = os.fstat(fd)
        try:
            got, st = loc.open_inside(key, os.O_RDONLY, with_stat=True)
            os.close(got)
            same = (st.st_dev, st.st_ino) == (src.st_dev, src.st_ino)
        except (DamagedStoreError, FileNotFoundError):  # a link was linked: not the file opened
            same = False
        if same:
            return ""
        loc.delete(key)
        why = f"the file linked from {path} is not the one opened (replaced during the import)"
    with contextlib.suppress(OSError):  # no empty folder left (a later pack may still be linked there)
        os.rmdir(dest.parent)
    return why
