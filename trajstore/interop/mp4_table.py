"""An MP4's video sample table read from its ``moov`` box: where every packet is, without reading them.

Demuxing an MP4 (:func:`~.lerobot_video.index_packets` through PyAV) reads every packet's bytes
(a camera's whole file) only to learn where the packets are and when; the file's ``moov`` box
already says so in a few tens of kilobytes.  :func:`plain_table` reads it (the top-level box
headers, then the ``moov`` box whole, at most :data:`MAX_MOOV_BYTES`) and returns the first video
track's samples, **only when the table is plain**: one sample description, no composition offsets
(``ctts``: display order is decode order), no fragments (``mvex``), no edit list or one that maps
the whole media from time 0 at rate 1, every sample non-empty and inside the file.  Then FFmpeg's
demuxer gives exactly these packets (presentation time = decode time = the sum of ``stts``
durations, file position from ``stsc``/``stco``/``stsz``, keyframes from ``stss``), and
:func:`~.lerobot_video.index_packets` still checks the first packet and the frame count against
FFmpeg's.  Anything else returns None and the caller demuxes as before: this is a shortcut for the
common file (LeRobot's, FFmpeg's muxer), never a second opinion on an unusual one.

Every length and count read here is input: each is checked against the bytes that hold it before
any array is built (a malformed table is not plain, so the demuxer, and its errors, decide).
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np

__all__ = ["MAX_MOOV_BYTES", "MAX_SAMPLES", "SampleTable", "plain_table"]

#: The largest ``moov`` box read (about 4 million samples); a larger one is demuxed instead.
MAX_MOOV_BYTES = 64 << 20
#: The most samples read from a table (what :data:`MAX_MOOV_BYTES` of sample sizes hold): a table
#: of one uniform size states its count in 4 bytes, so the count alone must not size the arrays.
MAX_SAMPLES = MAX_MOOV_BYTES // 4
_CONTAINERS = {"moov", "trak", "mdia", "minf", "stbl", "edts"}


class SampleTable(NamedTuple):
    """One video track's samples in file order: ``pts`` (int64, in ``timescale`` units), ``pos``
    and ``size`` (int64 bytes), ``keys`` (bool)."""

    pts: np.ndarray
    pos: np.ndarray
    size: np.ndarray
    keys: np.ndarray
    timescale: int


class _NotPlain(Exception):
    """The table is not one :func:`plain_table` reads (the caller demuxes instead)."""


def _read(fileobj: Any, offset: int, n: int) -> bytes:
    fileobj.seek(offset)
    data = bytes(fileobj.read(n))
    if len(data) != n:
        raise _NotPlain("short read")
    return data


def _boxes(data: bytes, lo: int, hi: int) -> dict[str, list[tuple[int, int]]]:
    """The boxes ``{type: [(payload start, end)...]}`` laid in ``data[lo:hi]``."""
    out: dict[str, list[tuple[int, int]]] = {}
    while lo < hi:
        if lo + 8 > hi:
            raise _NotPlain("a box header runs past its parent")
        n, kind = struct.unpack_from(">I4s", data, lo)
        head = 8
        if n == 1:
            if lo + 16 > hi:
                raise _NotPlain("a box header runs past its parent")
            n, head = struct.unpack_from(">Q", data, lo + 8)[0], 16
        if n < head or lo + n > hi:
            raise _NotPlain("a box runs past its parent")
        out.setdefault(kind.decode("latin-1"), []).append((lo + head, lo + n))
        lo += n
    return out


def _one(boxes: dict[str, list[tuple[int, int]]], kind: str) -> tuple[int, int]:
    got = boxes.get(kind, [])
    if len(got) != 1:
        raise _NotPlain(f"{len(got)} {kind} boxes")
    return got[0]


def _moov(fileobj: Any, file_size: int) -> bytes:
    """The top-level ``moov`` box's bytes (only the box headers before it are read on the way)."""
    off = 0
    while off + 8 <= file_size:
        n, kind = struct.unpack(">I4s", _read(fileobj, off, 8))
        head = 8
        if n == 1:
            n, head = struct.unpack(">Q", _read(fileobj, off + 8, 8))[0], 16
        elif n == 0:
            n = file_size - off
        if n < head or off + n > file_size:
            raise _NotPlain("a top-level box runs past the file")
        if kind == b"moov":
            if n > MAX_MOOV_BYTES:
                raise _NotPlain("the moov box is larger than read here")
            return _read(fileobj, off, n)
        off += n
    raise _NotPlain("no moov box")


def _table(data: bytes, lo: int, hi: int, head: int, width: int, fmt: str, count_at: int = 4) -> np.ndarray:
    """The ``count`` entries of ``width`` big-endian ``fmt`` fields after a full box's ``head``
    bytes (its count at ``count_at``), as (count, width) int64."""
    if hi - lo < head:
        raise _NotPlain("a table box is too short")
    count = struct.unpack_from(">I", data, lo + count_at)[0]
    item = np.dtype(fmt).itemsize
    if count * width * item > hi - lo - head:
        raise _NotPlain("a table announces more entries than it holds")
    return np.frombuffer(data, fmt, count * width, lo + head).astype(np.int64).reshape(count, width)


def _video_trak(moov: bytes, top: dict[str, list[tuple[int, int]]]) -> dict[str, list[tuple[int, int]]]:
    """The boxes of the first track whose handler is ``vide``."""
    for lo, hi in top.get("trak", []):
        trak = _boxes(moov, lo, hi)
        mdia = _boxes(moov, *_one(trak, "mdia"))
        h_lo, h_hi = _one(mdia, "hdlr")
        if h_hi - h_lo >= 12 and moov[h_lo + 8 : h_lo + 12] == b"vide":
            return trak
    raise _NotPlain("no video track")


def _edit_is_whole(moov: bytes, trak: dict[str, list[tuple[int, int]]], movie_scale: int, media_scale: int,
                   media_duration: int) -> None:
    """An edit list, if any, must map the whole media from time 0 at rate 1 (one entry)."""
    if "edts" not in trak:
        return
    lo, hi = _one(_boxes(moov, *_one(trak, "edts")), "elst")
    version = moov[lo] if hi > lo else -1
    fmt = {0: ">IiI", 1: ">QqI"}.get(version)
    if fmt is None or hi - lo != 8 + struct.calcsize(fmt) or struct.unpack_from(">I", moov, lo + 4)[0] != 1:
        raise _NotPlain("an edit list of other than one entry")
    duration, media_time, rate = struct.unpack_from(fmt, moov, lo + 8)
    short = duration and (duration + 1) * media_scale < media_duration * movie_scale
    if media_time != 0 or rate != 1 << 16 or short:
        raise _NotPlain("an edit list that shifts, cuts or scales the media")


def _sizes(moov: bytes, stbl: dict[str, list[tuple[int, int]]]) -> np.ndarray:
    """Every sample's size from ``stsz`` (int64, all > 0)."""
    z_lo, z_hi = _one(stbl, "stsz")
    if z_hi - z_lo < 12:
        raise _NotPlain("a short stsz")
    uniform, n = struct.unpack_from(">II", moov, z_lo + 4)
    if not n or n > MAX_SAMPLES:  # a count from the file: bounded before any array is sized by it
        raise _NotPlain(f"{n} samples")
    size = np.full(n, uniform, np.int64) if uniform else _table(moov, z_lo, z_hi, 12, 1, ">u4", 8)[:, 0]
    if len(size) != n or (size <= 0).any():
        raise _NotPlain("empty samples")
    return size.astype(np.int64, copy=False)


def _samples(moov: bytes, stbl: dict[str, list[tuple[int, int]]], file_size: int) -> tuple[np.ndarray, ...]:
    """``(pts, pos, size, keys)`` from the sample table boxes."""
    if "ctts" in stbl or ("co64" in stbl and "stco" in stbl):
        raise _NotPlain("composition offsets, or two chunk offset tables")
    d_lo, d_hi = _one(stbl, "stsd")
    if d_hi - d_lo < 8 or struct.unpack_from(">I", moov, d_lo + 4)[0] != 1:
        raise _NotPlain("other than one sample description")
    size = _sizes(moov, stbl)
    n = len(size)
    stts = _table(moov, *_one(stbl, "stts"), 8, 2, ">u4")
    if int(stts[:, 0].sum()) != n:
        raise _NotPlain("stts counts another number of samples")
    pts = np.concatenate([[0], np.cumsum(np.repeat(stts[:, 1], stts[:, 0]))[:-1]]).astype(np.int64)
    wide = "co64" in stbl
    chunks = _table(moov, *_one(stbl, "co64" if wide else "stco"), 8, 1, ">u8" if wide else ">u4")[:, 0]
    stsc = _table(moov, *_one(stbl, "stsc"), 8, 3, ">u4")
    first = stsc[:, 0]
    if not len(first) or first[0] != 1 or (np.diff(first) <= 0).any() or first[-1] > len(chunks) or (stsc[:, 1] <= 0).any():
        raise _NotPlain("a malformed stsc")
    per_chunk = np.repeat(stsc[:, 1], np.diff(np.append(first, len(chunks) + 1)))
    if int(per_chunk.sum()) != n:
        raise _NotPlain("the chunks hold another number of samples")
    chunk_of = np.repeat(np.arange(len(chunks)), per_chunk)
    ends = np.cumsum(size)
    chunk_start = np.concatenate([[0], np.cumsum(per_chunk)[:-1]])
    pos = chunks[chunk_of] + (ends - size) - (ends - size)[chunk_start][chunk_of]
    if (pos < 0).any() or int((pos + size).max()) > file_size:
        raise _NotPlain("samples outside the file")
    if "stss" in stbl:
        sync = _table(moov, *_one(stbl, "stss"), 8, 1, ">u4")[:, 0]
        if ((sync < 1) | (sync > n)).any():
            raise _NotPlain("a sync sample outside the track")
        keys = np.zeros(n, bool)
        keys[sync - 1] = True
    else:
        keys = np.ones(n, bool)
    return pts, pos, size, keys


def plain_table(fileobj: Any, file_size: int | None = None) -> SampleTable | None:
    """The first video track's :class:`SampleTable` of the MP4 ``fileobj`` (seekable, binary), or
    None when its table is not plain (see the module's docstring) or does not parse."""
    try:
        if file_size is None:
            file_size = int(fileobj.seek(0, os.SEEK_END))
        moov = _moov(fileobj, file_size)
        top = _boxes(moov, 8, len(moov))
        if "mvex" in top:
            raise _NotPlain("a fragmented MP4")
        mv_lo, mv_hi = _one(top, "mvhd")
        trak = _video_trak(moov, top)
        mdia = _boxes(moov, *_one(trak, "mdia"))
        md_lo, md_hi = _one(mdia, "mdhd")
        wide_mv, wide_md = moov[mv_lo] == 1, moov[md_lo] == 1  # version 1: 64-bit times before the timescale
        if mv_hi - mv_lo < (24 if wide_mv else 16) or md_hi - md_lo < (32 if wide_md else 20):
            raise _NotPlain("short mvhd or mdhd")
        movie_scale = struct.unpack_from(">I", moov, mv_lo + (20 if wide_mv else 12))[0]
        scale, duration = struct.unpack_from(">IQ" if wide_md else ">II", moov, md_lo + (20 if wide_md else 12))
        if not scale or not movie_scale:
            raise _NotPlain("a zero timescale")
        _edit_is_whole(moov, trak, movie_scale, scale, duration)
        stbl = _boxes(moov, *_one(_boxes(moov, *_one(mdia, "minf")), "stbl"))
        pts, pos, size, keys = _samples(moov, stbl, file_size)
    except (_NotPlain, OSError, ValueError, struct.error):
        return None
    return SampleTable(pts, pos, size, keys, int(scale))
