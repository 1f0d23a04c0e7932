"""``trajstore verify`` of a video field (:func:`check_video`): its segment index, each segment's
frame table, a linked segment's pack (:mod:`.video_pack`) and, with ``deep``, every frame decoded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trajstore.errors import DamagedStoreError, TrajstoreError
from trajstore.storage.fields.chunked import map_file
from trajstore.storage.fields.video import AnySegment, index_key, load_segment, read_index, segment_key
from trajstore.storage.fields.video_codec import VideoCodec, codec_from_attrs
from trajstore.storage.fields.video_pack import is_pack_key
from trajstore.storage.location import Location

__all__ = ["check_video"]

#: A fault: ``(kind, key, message, first row, end row)``.
Fault = tuple[str, str, str, int, int]


def _segment_buffer(loc: Location, key: str, limit: int) -> tuple[np.ndarray | None, object]:
    """Segment ``key``'s bytes (uint8) and their owner, ``(None, None)`` when it is missing; a
    file larger than ``limit`` raises DamagedStoreError.  A local file is mapped, not read: what
    :func:`~.video.read_segment` checks (the magic, the frame table at the end, the file's size)
    touches its first and last pages only, so checking a store costs its frame tables, not its
    video bytes (the packets themselves are checked by decoding them: ``deep``; a linked segment's
    by their crc32c, read from its pack)."""
    if not loc.is_local:
        data = loc.get(key, limit=limit)
        return (None, None) if data is None else (np.frombuffer(data, np.uint8), data)
    buf, owner = map_file(loc, key, limit)
    if buf is None:
        if loc.exists(key):
            raise DamagedStoreError(f"{key}: the segment file is empty or larger than the {limit} bytes its rows allow")
        return None, None
    if len(buf) > limit:
        raise DamagedStoreError(f"{key}: {len(buf)} bytes; its rows allow at most {limit}")
    return buf, owner


def _decode_all(codec: VideoCodec, seg: AnySegment, rows: int, row_shape: tuple[int, ...]) -> None:
    """Decode every GOP of ``seg`` (``rows`` frames); raises what the decoder raises."""
    out = np.empty((1, *row_shape), np.uint8)
    starts = seg.keys.tolist() + [rows]
    for a, b in zip(starts[:-1], starts[1:]):
        codec.decode(seg.packets(a, b), b - a, {}, out)


def _one(loc: Location, array_path: str, lo: int, hi: int, limit: int, packs: bool,
         faults: list[Fault]) -> AnySegment | None:
    """Segment ``[lo, hi)`` checked (its faults appended), or None when it cannot be read."""
    key = segment_key(array_path, lo)
    try:
        buf, owner = _segment_buffer(loc, key, limit)
        if buf is None:
            faults.append(("missing-chunk", key, f"{key}: video segment missing; rows [{lo}, {hi}) are lost", lo, hi))
            return None
        return load_segment(loc, array_path, buf, hi - lo, owner, key, check_bytes=packs, limit=limit)
    except (ValueError, DamagedStoreError) as e:
        faults.append(("bad-chunk", key, f"{key}: damaged video segment ({e}); rows [{lo}, {hi}) are unreadable",
                       lo, hi))
        return None


def check_video(loc: Location, array_path: str, row_shape: tuple[int, ...], settings: Any, end: int,
                deep: bool, packs: bool = True) -> tuple[list[Fault], int, list[str]]:
    """Verify a video field's committed rows ``[0, end)``: the index covers them, every segment of
    them is there and its frame table checks, a linked segment's pack is a regular file inside
    the store holding its bytes and (``packs``) those bytes match their crc32c; ``deep``: every
    frame decodes, of ``row_shape``.

    Returns ``(faults, segments decoded, keys holding no committed row)``, each fault
    ``(kind, key, message, first row, end row)`` with kind ``missing-chunk``, ``bad-chunk`` or
    ``undecodable-chunk``.  Reads go through the confined, bounded reader; sizes are checked first.
    """
    faults: list[Fault] = []
    ikey = index_key(array_path)
    row_bytes = int(np.prod(row_shape, dtype=np.int64))
    try:
        codec = codec_from_attrs(settings)
        data = loc.get(ikey, limit=8 * (end + 2) + 64 + (1 << 20))
        bounds = read_index(data, 1 << 62) if data is not None else np.zeros(1, np.int64)
    except (ValueError, DamagedStoreError) as e:
        return [("bad-chunk", ikey, f"{ikey}: the video settings or segment index are damaged ({e}); rows "
                 f"[0, {end}) are unreadable", 0, end)], 0, []
    if int(bounds[-1]) < end:
        lo = int(bounds[-1])
        faults.append(("missing-chunk", ikey, f"{ikey}: the video segments end at row {lo} but {end} rows are "
                       f"committed; rows [{lo}, {end}) are lost", lo, end))
    decoded = 0
    named = {segment_key(array_path, int(b)) for b in bounds[:-1] if int(b) < end} | {ikey}
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if lo >= end:
            break
        seg = _one(loc, array_path, lo, hi, (hi - lo) * (2 * row_bytes + 88) + 4096, packs, faults)
        if seg is None:
            continue
        if not deep:
            continue
        try:
            _decode_all(codec, seg, hi - lo, row_shape)
            decoded += 1
        except TrajstoreError:
            raise
        except Exception as e:  # the packets are input
            key = segment_key(array_path, lo)
            faults.append(("undecodable-chunk", key, f"{key}: video segment does not decode ({type(e).__name__}: "
                           f"{e}); rows [{lo}, {hi}) are damaged", lo, hi))
    try:  # segments of rows no record counts (a writer killed before its record, cleared rows); packs are
        # never removable: only an import makes them, and a damaged linked segment keeps naming its pack
        extra = [k for k in loc.list_prefix(f"{array_path}/video") if k not in named and not is_pack_key(k)]
    except DamagedStoreError:
        extra = []
    return faults, decoded, extra
