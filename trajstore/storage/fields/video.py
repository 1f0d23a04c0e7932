"""``VideoField``: a step field kept as video, one encoded stream per episode (docs/format.md "Video fields").

On disk, next to the field's zarr array (which holds its metadata and the codec settings in the
attribute :data:`~.video_codec.VIDEO_ATTR`, and no chunks):

- ``<field>/video/<lo>``: one *segment*, the stream of physical rows ``[lo, hi)``: the magic
  ``TSVSEG01``, the packets (one per frame, display order), then a table of ``(offset, size,
  keyframe)`` u64 triples (one per frame), the frame count (u64) and the crc32c of table and count;
- or a *linked segment* (magic ``TSVLNK01``, :mod:`.video_pack`): the same table, naming bytes of
  a pack ``<field>/video/pack/<k>`` (a file shared with an import's source through a hard link)
  instead of holding the packets;
- ``<field>/video/index``: the magic ``TSVIDX01``, a count ``m`` (u64), the segment bounds
  ``0 = b0 < b1 < ... < b(m-1)`` (u64: segment ``i`` holds rows ``[b(i), b(i+1))``) and their crc32c.

Writing: the writer holds the frames of the episode being recorded in RAM and encodes it as one
segment when the episode ends (:meth:`VideoField.end_run`; a run longer than
:data:`MAX_RUN_ROWS` is cut), at a commit that seals (an explicit ``flush``, ``close``) or never.
Segments are written first, the index next (both temp + rename), the commit record last; an
automatic commit counts rows only up to the first row still held (:attr:`VideoField.open_from`),
so every committed row's frame is in a segment named by the index, and a SIGKILL at any instant
leaves the last commit.  A reopened writer drops index entries past the committed rows.

Reading: a frame decodes from the keyframe before it, forward; a batch groups its frames by
(segment, keyframe) so each GOP is decoded once per batch (windows of consecutive frames too), one
frame in memory at a time, the groups on the decode threads (:func:`.image.parallel`).  Segment
and index bytes are read through the store's confined, bounded reader and checked before use.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Union

import google_crc32c
import numpy as np
import zarr

from trajstore.errors import BadOptionError, DamagedStoreError, ForeignFileError, TrajstoreError
from trajstore.storage.confined import MAX_FILE_BYTES, full_disk
from trajstore.storage.fields.base import gather_windows_by_rows
from trajstore.storage.fields.chunked import map_file
from trajstore.storage.fields.image import parallel
from trajstore.storage.fields.spec import FieldSpec
from trajstore.storage.fields.video_codec import VIDEO_ATTR, VideoCodec, codec_from_attrs
from trajstore.storage.fields.video_guard import GuardedEncoder
from trajstore.storage.fields.video_pack import LINK_MAGIC, LinkedSegment, open_linked
from trajstore.storage.location import Location
from trajstore.storage.spans import PutData

__all__ = ["MAX_RUN_ROWS", "AnySegment", "Segment", "VideoField", "index_key", "load_segment", "plain_bytes",
           "read_index", "read_segment", "segment_frame", "segment_key", "write_index", "write_segment"]

SEG_MAGIC, IDX_MAGIC = b"TSVSEG01", b"TSVIDX01"
#: A run (episode) longer than this many frames is cut into segments of this many: the writer
#: holds a run's frames raw until it is encoded, so this bounds its memory.
MAX_RUN_ROWS = 1024
#: Segments kept open (mapped locally, fetched bytes elsewhere) per field.
MAX_SEGMENTS = 64


def segment_key(array_path: str, lo: int) -> str:
    """Key of the segment whose first physical row is ``lo``."""
    return f"{array_path}/video/{lo}"


def index_key(array_path: str) -> str:
    """Key of the field's segment index."""
    return f"{array_path}/video/index"


def _crc(b: bytes) -> bytes:
    return int(google_crc32c.value(b)).to_bytes(4, "little")


def segment_frame(sizes: np.ndarray, keyframes: Sequence[bool] | np.ndarray) -> tuple[bytes, bytes]:
    """``(head, tail)`` of the segment of packets of ``sizes`` (n,) bytes each, laid one after
    another between them: the magic, and the ``(offset, size, keyframe)`` table, count and crc32c.
    ``head + b"".join(packets) + tail`` is :func:`write_segment`'s result; a caller holding the
    packets contiguous (an MP4's samples) reads them straight into place instead."""
    sizes = np.asarray(sizes, np.uint64)
    table = np.zeros((len(sizes), 3), "<u8")
    table[:, 0] = len(SEG_MAGIC) + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    table[:, 1] = sizes
    table[:, 2] = np.asarray(keyframes, bool)
    tail = table.tobytes() + struct.pack("<Q", len(sizes))
    return SEG_MAGIC, tail + _crc(tail)


def write_segment(packets: Sequence[bytes], keyframes: Sequence[bool]) -> bytes:
    """One segment's bytes: magic, packets, their ``(offset, size, keyframe)`` table, count, crc32c."""
    head, tail = segment_frame(np.fromiter(map(len, packets), np.uint64, len(packets)), keyframes)
    return head + b"".join(packets) + tail


class Segment:
    """A checked segment: ``buf`` (uint8), per frame ``offsets``/``sizes`` (int64) and ``keys``
    (int64 positions of the keyframes, the first 0); ``owner`` keeps ``buf``'s memory alive."""

    __slots__ = ("buf", "keys", "offsets", "owner", "sizes")

    def __init__(self, buf: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray, owner: object):
        self.buf, self.offsets, self.sizes, self.keys, self.owner = buf, offsets, sizes, keys, owner

    def packets(self, a: int, b: int) -> list[np.ndarray]:
        """The packets of frames ``[a, b)``."""
        return [self.buf[o : o + s] for o, s in zip(self.offsets[a:b].tolist(), self.sizes[a:b].tolist())]


def read_segment(buf: np.ndarray, rows: int, owner: object) -> Segment:
    """Check segment ``buf`` (uint8) against the ``rows`` frames the index gives it.

    Raises ValueError naming what is wrong: magic, count, checksum, a packet outside the packet
    area or empty, a first frame that is no keyframe."""
    n = len(buf)
    tail = 24 * rows + 8
    if n < len(SEG_MAGIC) + tail + 4 or buf[: len(SEG_MAGIC)].tobytes() != SEG_MAGIC:
        raise ValueError(f"{n} bytes are no segment of {rows} frames (magic or size)")
    t = buf[n - tail - 4 : n - 4].tobytes()
    if _crc(t) != buf[n - 4 :].tobytes():
        raise ValueError("the segment's frame table checksum does not match")
    count = struct.unpack("<Q", t[-8:])[0]
    if count != rows:
        raise ValueError(f"the segment holds {count} frames; the index gives it {rows}")
    table = np.frombuffer(t[:-8], "<u8").reshape(rows, 3)
    end = np.uint64(n - tail - 4)
    off, size, key = table[:, 0], table[:, 1], table[:, 2]
    bad = (off < len(SEG_MAGIC)) | (off > end) | (size == 0) | (size > end - np.minimum(off, end)) | (key > 1)
    if bad.any():
        raise ValueError(f"the frame table places frame {int(np.flatnonzero(bad)[0])} outside the packets")
    if rows and not key[0]:
        raise ValueError("the segment's first frame is not a keyframe")
    return Segment(buf, off.astype(np.int64), size.astype(np.int64), np.flatnonzero(key).astype(np.int64), owner)


#: A segment as read: its packets held (mapped or fetched), or read from a pack when asked for.
AnySegment = Union[Segment, LinkedSegment]


def load_segment(loc: Location, array_path: str, buf: np.ndarray, rows: int, owner: object, where: str,
                 check_bytes: bool = True, limit: int = MAX_FILE_BYTES) -> AnySegment:
    """The segment whose file holds ``buf`` (uint8), plain (:func:`read_segment`) or linked
    (:func:`~.video_pack.open_linked`, ``check_bytes`` and ``limit`` as there); raises as they do."""
    if buf[: len(LINK_MAGIC)].tobytes() == LINK_MAGIC:
        return open_linked(loc, array_path, buf, rows, where, check_bytes, limit)
    return read_segment(buf, rows, owner)


def plain_bytes(seg: AnySegment) -> bytes:
    """``seg`` as a plain segment's bytes (a linked one's packets read from its pack): what a copy
    writes, so that every copy holds its own packets."""
    if isinstance(seg, Segment):
        return seg.buf.tobytes()
    return write_segment([p.tobytes() for p in seg.packets(0, len(seg.offsets))], seg.keyframe_flags())


def write_index(bounds: Sequence[int]) -> bytes:
    """The index's bytes for segment bounds ``bounds`` (``[0, hi0, hi1, ...]``)."""
    body = np.asarray(bounds, "<u8").tobytes()
    return IDX_MAGIC + struct.pack("<Q", len(bounds)) + body + _crc(body)


def read_index(data: bytes, max_rows: int) -> np.ndarray:
    """The segment bounds (int64, starting at 0, strictly increasing, at most ``max_rows``) of index
    bytes ``data``; ValueError naming what is wrong."""
    if len(data) < 20 or data[:8] != IDX_MAGIC:
        raise ValueError("not a segment index (magic)")
    m = struct.unpack("<Q", data[8:16])[0]
    if len(data) != 20 + 8 * m or m < 1:
        raise ValueError(f"an index of {len(data)} bytes cannot hold the {m} bounds it announces")
    body = data[16 : 16 + 8 * m]
    if _crc(body) != data[16 + 8 * m :]:
        raise ValueError("the segment index checksum does not match")
    b = np.frombuffer(body, "<u8")
    if b[0] != 0 or (m > 1 and not (b[1:] > b[:-1]).all()) or int(b[-1]) > max_rows:
        raise ValueError(f"segment bounds {b[:8].tolist()}... do not rise from 0 to at most {max_rows} rows")
    return b.astype(np.int64)


class VideoField:
    """A field of frames (RGB, grey, stacks of grey planes) stored as video per episode (a
    :class:`~trajstore.storage.fields.base.Field`)."""

    keeps_partial_chunk = False

    def __init__(self, loc: Location, spec: FieldSpec, zarray: zarr.Array[Any], writable: bool):
        self.loc, self.spec, self.writable = loc, spec, writable
        self.C = spec.chunk_rows
        self.allocated = int(zarray.shape[0])
        try:
            self.codec: VideoCodec = codec_from_attrs(zarray.attrs.get(VIDEO_ATTR))
            self.codec.check(spec.row_shape, spec.dtype)
        except (ValueError, TypeError) as e:
            raise DamagedStoreError(f"{loc.url}: {spec.array_path}: video settings are not ones this version "
                                    f"reads ({e})") from None
        self._bounds = np.zeros(1, np.int64)  # segment bounds as last read or written
        self._segments: OrderedDict[int, AnySegment] = OrderedDict()
        self._limit = 2 * spec.row_bytes + 64  # per frame: plausible encoded bytes, at most
        # Writer: frames of rows [open_lo, open_lo + held) not yet in a segment, and episode ends.
        self._open_lo, self._held = 0, 0
        self._blocks: list[np.ndarray] = []
        self._cuts: set[int] = set()
        self._started = False
        # Rows lo -> (n, fetch): a copy's pass-through of an encoded segment (:meth:`adopt`).
        self._adopted: dict[int, tuple[int, Callable[[], PutData]]] = {}
        self.encoder = GuardedEncoder()  # AV1 episodes in a child process under a watchdog (no process until one)

    @property
    def open_from(self) -> int | None:
        """First physical row whose frame is held in RAM, not yet in a segment (None: none)."""
        return self._open_lo if self._held else None

    def _where(self, rows: str) -> str:
        return f"{self.loc.url}: {self.spec.array_path}: {rows}"

    # -- the index and segments ---------------------------------------------------------------
    def _load_index(self, row: int) -> None:
        """Read the segment index again (``row``: the physical row that needs it, for messages)."""
        limit = 8 * (self.allocated + 2) + 64
        where = self._where(f"row {row} (physical): the video segment index {index_key(self.spec.array_path)}")
        try:
            data = self.loc.get(index_key(self.spec.array_path), limit=limit)
        except DamagedStoreError as e:
            raise DamagedStoreError(f"{where} is unreadable ({e})") from None
        if data is None:
            self._bounds = np.zeros(1, np.int64)
            return
        try:
            self._bounds = read_index(data, self.allocated)
        except ValueError as e:
            raise DamagedStoreError(f"{where} is damaged ({e})") from None

    def _segment(self, i: int) -> AnySegment:
        lo, hi = int(self._bounds[i]), int(self._bounds[i + 1])
        seg = self._segments.get(lo)
        if seg is not None and len(seg.offsets) == hi - lo:
            self._segments.move_to_end(lo)
            return seg
        key = segment_key(self.spec.array_path, lo)
        limit = (hi - lo) * (self._limit + 24) + 4096
        where = self._where(f"rows {lo}..{hi - 1} (segment {key})")
        try:
            if self.loc.is_local:
                buf, owner = map_file(self.loc, key, limit)
                if buf is None and self.loc.exists(key):
                    raise ValueError("the segment file is empty or implausibly large")
            else:
                data = self.loc.get(key, limit=limit)
                buf, owner = (None, None) if data is None else (np.frombuffer(data, np.uint8), data)
            if buf is None:
                raise DamagedStoreError(f"{where} are committed, but the segment file is missing; run `trajstore verify`")
            seg = load_segment(self.loc, self.spec.array_path, buf, hi - lo, owner, where, limit=limit)
        except ForeignFileError:
            raise  # a foreign file served as a segment (open_lerobot's MP4s): its message names it
        except (ValueError, DamagedStoreError) as e:
            if isinstance(e, DamagedStoreError) and str(e).startswith(where):
                raise
            raise DamagedStoreError(f"{where} are damaged ({e})") from None
        self._segments[lo] = seg
        while len(self._segments) > MAX_SEGMENTS:
            self._segments.popitem(last=False)
        return seg

    # -- reads ---------------------------------------------------------------------------------
    def gather(self, phys: np.ndarray) -> np.ndarray:
        """Rows ``phys`` (B,) int64: a new (B, *row_shape) uint8 array; held rows from RAM, the others
        decoded GOP by GOP (each GOP of the batch once).

        Raises DamagedStoreError (a row past the index, a missing, damaged or undecodable segment)
        naming the field and the row; MissingDependencyError without PyAV."""
        phys = np.asarray(phys, dtype=np.int64).ravel()
        out = np.zeros((len(phys), *self.spec.row_shape), dtype=self.spec.dtype)
        held = (phys >= self._open_lo) & (phys < self._open_lo + self._held) if self._held else np.zeros(len(phys), bool)
        if held.any():
            starts = np.cumsum([0] + [len(b) for b in self._blocks])
            rel = phys[held] - self._open_lo
            which = np.searchsorted(starts, rel, side="right") - 1
            out[held] = [self._blocks[k][r - starts[k]] for k, r in zip(which.tolist(), rel.tolist())]
        rest = np.flatnonzero(~held)
        if not len(rest):
            return out
        rows = phys[rest]
        if int(rows.max()) >= int(self._bounds[-1]):
            self._load_index(int(rows.max()))
            if int(rows.max()) >= int(self._bounds[-1]):
                r = int(rows[rows >= self._bounds[-1]][0])
                raise DamagedStoreError(self._where(f"row {r} (physical) is past the video segments, which end at "
                                                    f"row {int(self._bounds[-1])}; run `trajstore verify`"))
        seg_of = np.searchsorted(self._bounds, rows, side="right") - 1
        jobs: dict[tuple[int, int], list[tuple[int, int]]] = {}
        segs = {int(i): self._segment(int(i)) for i in np.unique(seg_of)}
        for pos, r, i in zip(rest.tolist(), rows.tolist(), seg_of.tolist()):
            local = r - int(self._bounds[i])
            keys = segs[i].keys
            k = int(keys[np.searchsorted(keys, local, side="right") - 1])
            jobs.setdefault((i, k), []).append((local, pos))
        self._decode(out, segs, list(jobs.items()))
        return out

    def _decode(self, out: np.ndarray, segs: dict[int, AnySegment],
                jobs: list[tuple[tuple[int, int], list[tuple[int, int]]]]) -> None:
        """Decode each GOP of ``jobs`` (``((segment, keyframe), [(frame, out position)...])``) once,
        from its keyframe to its last frame asked for, on the decode threads."""
        codec = self.codec

        def run(part: Iterable[tuple[tuple[int, int], list[tuple[int, int]]]]) -> None:
            for (i, k), want in part:
                last = max(f for f, _ in want)
                dest: dict[int, list[int]] = {}
                for f, p in want:
                    dest.setdefault(f - k, []).append(p)
                try:
                    codec.decode(segs[i].packets(k, last + 1), last + 1 - k, dest, out)
                except TrajstoreError:
                    raise
                except Exception as e:  # the packets are input: whatever garbage makes FFmpeg raise
                    lo = int(self._bounds[i])
                    raise DamagedStoreError(self._where(f"row {lo + last} (physical; segment of rows {lo}.."
                                                        f"{int(self._bounds[i + 1]) - 1}) does not decode "
                                                        f"({type(e).__name__}: {e})")) from None

        parallel(run, jobs)

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """``length`` consecutive rows from each of ``phys`` (B,), as one gather (one decode per GOP)."""
        return gather_windows_by_rows(self, phys, length)

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        """Physical rows ``[lo, hi)``, decoded (always a copy)."""
        return self.gather(np.arange(lo, hi, dtype=np.int64))

    def read_chunk(self, k: int) -> np.ndarray:
        """Rows of chunk ``k`` that are in segments or held; zeros for the others."""
        lo, hi = k * self.C, (k + 1) * self.C
        self._load_index(lo)
        top = max(int(self._bounds[-1]), self._open_lo + self._held)
        out = np.zeros((self.C, *self.spec.row_shape), self.spec.dtype)
        if top > lo:
            out[: min(hi, top) - lo] = self.gather(np.arange(lo, min(hi, top)))
        return out

    # -- writes --------------------------------------------------------------------------------
    def _refuse(self, what: str) -> BadOptionError:
        return BadOptionError(self._where(f"a video field's rows are written once, in order, by appends; {what} "
                                          "is not supported (copy the store without the field, or keep it with a "
                                          "per-frame image codec such as 'jpeg:90')"))

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        """Hold ``data`` (n, *row_shape) as rows ``[phys_lo, phys_lo + n)`` until their episode ends.

        Rows are appended once, in order: a write elsewhere (a rewrite, a ring) raises BadOptionError."""
        if phys_lo != self._open_lo + self._held or not self._started:
            if self._held:
                raise self._refuse("writing committed rows again (set_at, remove_at, episode edits, a ring)")
            # A writer's first write, or the first after clear(): segments past the committed rows
            # (a writer killed before its record, or cleared rows) are dropped from the index.
            self._load_index(phys_lo)
            keep = self._bounds[self._bounds <= phys_lo]
            if int(keep[-1]) != phys_lo:
                raise DamagedStoreError(self._where(f"the committed rows end at {phys_lo}, inside a video segment "
                                                    f"(bounds {keep[-3:].tolist()}...)"))
            self._bounds, self._open_lo, self._started = keep, phys_lo, True
        if len(data):
            # A block repeating one frame (zero row stride: an import's placeholder rows for a segment
            # it adopts) is held as it is, one frame of memory; any other block is copied.
            same = data.ndim and data.strides[0] == 0 and data.dtype == self.spec.dtype
            self._blocks.append(data if same else np.array(data, dtype=self.spec.dtype, copy=True))
            self._held += len(data)
        # A long episode and rare commits: bound the frames held (an adopted segment's placeholder
        # rows hold one frame, not one per row, and its bytes are written at the next commit).
        if self._held >= 2 * MAX_RUN_ROWS and sum(len(b) for b in self._blocks if b.strides[0]) >= 2 * MAX_RUN_ROWS:
            self.flush(False)

    def _held_rows(self, a: int, b: int) -> np.ndarray:
        """Held physical rows ``[a, b)`` as one array (a view where they lie in one block)."""
        parts, pos = [], self._open_lo
        for blk in self._blocks:
            lo, hi = max(a, pos), min(b, pos + len(blk))
            if lo < hi:
                parts.append(blk[lo - pos : hi - pos])
            pos += len(blk)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def end_run(self, row: int) -> None:
        """An episode ends before physical row ``row``: its frames form one segment."""
        if self._open_lo < row <= self._open_lo + self._held:
            self._cuts.add(row)

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Encode every run that ended (and pieces of :data:`MAX_RUN_ROWS` of a longer one) into a
        segment, then write the index; the run still open stays held."""
        lo, top = self._open_lo, self._open_lo + self._held
        runs = []
        cuts = self._cuts | {x for a, (n, _f) in self._adopted.items() for x in (a, a + n)}
        for c in sorted(c for c in cuts if lo < c <= top):
            while c - lo > MAX_RUN_ROWS:
                runs.append((lo, lo + MAX_RUN_ROWS))
                lo += MAX_RUN_ROWS
            runs.append((lo, c))
            lo = c
        while top - lo >= MAX_RUN_ROWS:  # the open run: whole pieces only
            runs.append((lo, lo + MAX_RUN_ROWS))
            lo += MAX_RUN_ROWS
        if not runs:
            return
        bounds = list(self._bounds.tolist())
        try:
            for a, b in runs:
                adopted = self._adopted.get(a)
                if adopted is not None and adopted[0] == b - a:  # the copy's segment, byte for byte
                    blob = adopted[1]()
                else:
                    frames = self._held_rows(a, b)
                    blob = write_segment(*self.encoder.encode(self.codec, frames, self._where(f"rows {a}..{b - 1}")))
                self.loc.put(segment_key(self.spec.array_path, a), blob, fsync=fsync)
                bounds.append(b)
            self.loc.put(index_key(self.spec.array_path), write_index(bounds), fsync=fsync)
        except OSError as e:
            raise full_disk(e, self.loc.url, f"write the video of {self.spec.array_path}")
        done = runs[-1][1]
        self._bounds = np.asarray(bounds, np.int64)
        self._blocks = [self._held_rows(done, self._open_lo + self._held)] if done < self._open_lo + self._held else []
        self._held -= done - self._open_lo
        self._open_lo = done
        self._cuts = {c for c in self._cuts if c > done}
        self._adopted = {a: v for a, v in self._adopted.items() if a >= done}

    # -- copies that keep episodes whole -----------------------------------------------------------
    def segments_within(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The segments ``(first row, end row)`` lying wholly inside physical rows ``[lo, hi)``."""
        if int(self._bounds[-1]) < hi:
            self._load_index(hi - 1)
        b = self._bounds.tolist()
        return [(a, c) for a, c in zip(b[:-1], b[1:]) if a >= lo and c <= hi]

    def segment_bytes(self, lo: int, hi: int) -> bytes:
        """The bytes of the segment of rows ``[lo, hi)`` (one of :meth:`segments_within`), checked; a
        linked segment as the plain segment of its packets (:func:`plain_bytes`)."""
        i = int(np.searchsorted(self._bounds, lo))
        if i >= len(self._bounds) - 1 or int(self._bounds[i]) != lo or int(self._bounds[i + 1]) != hi:
            raise DamagedStoreError(self._where(f"rows {lo}..{hi - 1} are no longer one video segment"))
        return plain_bytes(self._segment(i))

    def adopt(self, lo: int, n: int, fetch: Callable[[], PutData]) -> None:
        """Rows ``[lo, lo + n)``, about to be written with the frames a segment of another field with
        the same settings decodes to, are stored as that segment's bytes (``fetch()``: bytes, or
        pieces of them (:mod:`~trajstore.storage.spans`) read when the segment is written), not
        encoded again: a copy that keeps episodes whole loses nothing more."""
        self._adopted[lo] = (n, fetch)

    # -- the rest of the Field protocol ----------------------------------------------------------
    def grow(self, allocated: int) -> None:
        """Rows the table allocates (bounds the index this field accepts)."""
        self.allocated = allocated

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Nothing to map: segments are read on demand (the index when a row is past it)."""

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        """Refused: video rows are not rewritten (BadOptionError)."""
        raise self._refuse("rewriting rows")

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Refused: video rows are not rewritten (BadOptionError)."""
        raise self._refuse("rewriting rows")

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Refused: video rows are not rewritten (BadOptionError)."""
        raise self._refuse("rewriting rows")

    def reload(self) -> None:
        """Read segments and the index afresh."""
        self.drop_cache()

    def drop_cache(self) -> None:
        """Forget open segments (and, reading, the index): another process may have written more."""
        self._segments.clear()
        self._bounds = self._bounds[:1] if not self.writable else self._bounds

    def close(self) -> None:
        """Release segments and held frames; stop the encoder child."""
        self._segments.clear()
        self._blocks, self._held = [], 0
        self.encoder.close()
