"""LeRobot's MP4 shards: one episode's packets taken out of a shard as they are, and MP4s written.

LeRobot v3 keeps each camera as MP4 files holding many episodes one after another (v2.1: one
file per episode); an episode is the frames whose presentation time lies in ``[from_timestamp,
to_timestamp)`` of its file.  LeRobot encodes each episode on its own and concatenates the
files without re-encoding, so every episode starts on a keyframe.

:func:`index_packets` indexes an MP4 once into an :class:`Mp4Index` of its packets (time, file
offset, size, keyframe): from its ``moov`` sample table where that is plain (:mod:`.mp4_table`;
the packets are not read), else by demuxing it (PyAV, no decoding); :meth:`Mp4Index.episode`
gives one episode's packets, read at their offsets, and :meth:`Mp4Index.segment` the episode's
segment (AV1 in a local file: pieces whose packets are copied file to file), as a trajstore video
segment holds them
(:func:`~trajstore.storage.fields.video.write_segment`: one packet per frame in display order,
each keyframe carrying its stream headers):

- AV1 (``libsvtav1``, LeRobot's default): MP4 samples are the low-overhead OBU stream our
  decoder reads, keyframes carrying the sequence header, so packets pass byte for byte;
- H.264: MP4 samples are length-prefixed NAL units (AVCC) with the SPS/PPS in the file's
  ``avcC`` box; they become Annex B (start codes), each keyframe prefixed by the SPS/PPS.

An episode that does not start on a keyframe, a stream whose packets are not in display order
(B-frames) or another codec is *not adoptable* (:meth:`Mp4Index.adoptable`): an import decodes it
(:func:`episode_frames`) and encodes it again, and says so.  Everything in an MP4 is input: frame sizes are checked
against the declared feature, and every PyAV failure becomes a :class:`ForeignFileError`
naming the file.
"""

from __future__ import annotations

import io
import itertools
import os
import threading
from fractions import Fraction
from typing import Any

import numpy as np

from trajstore.errors import ForeignFileError, MissingDependencyError
from trajstore.interop.mp4_table import SampleTable, plain_table
from trajstore.storage.fields.video import segment_frame, write_segment
from trajstore.storage.fields.video_codec import VideoCodec
from trajstore.storage.fields.video_guard import GuardedEncoder
from trajstore.storage.spans import FileSpan, PutData

__all__ = ["episode_frames", "Mp4Writer", "Mp4Index", "index_packets", "ADOPTABLE",
           "av_module"]

#: MP4 codec names (as FFmpeg names the stream) whose packets become trajstore segments unchanged
#: (after AVCC -> Annex B for H.264), and the trajstore codec they decode with.
ADOPTABLE = {"av1": "av1", "libdav1d": "av1", "h264": "h264"}
#: Packets of one episode read at most (a camera at 1 kHz for 10 minutes).
MAX_EPISODE_PACKETS = 1 << 20
#: Bytes of one episode's packets read at most.
MAX_SEGMENT_BYTES = 1 << 32
#: Bytes of frames an :class:`Mp4Writer` holds at most before it encodes them (a piece: episodes, or
#: part of a long one).
PIECE_BYTES = 256 << 20


def av_module(what: str) -> Any:
    """PyAV, or MissingDependencyError naming the ``video`` extra."""
    try:
        import av
    except ImportError:
        raise MissingDependencyError(f"{what}: LeRobot's videos need PyAV: pip install 'trajstore[video]'") from None
    return av


def _avcc_to_annexb(sample: bytes, where: str) -> bytes:
    """An MP4 H.264 sample (4-byte big-endian NAL lengths) as Annex B (start codes)."""
    out, i, n = [], 0, len(sample)
    while i < n:
        if i + 4 > n:
            raise ForeignFileError(f"{where}: an H.264 sample ends inside a NAL length")
        size = int.from_bytes(sample[i : i + 4], "big")
        if size == 0 or i + 4 + size > n:
            raise ForeignFileError(f"{where}: an H.264 NAL unit of {size} bytes runs past its sample")
        out += [b"\x00\x00\x00\x01", sample[i + 4 : i + 4 + size]]
        i += 4 + size
    return b"".join(out)


def _avcc_headers(extradata: bytes | None, where: str) -> bytes:
    """The SPS and PPS NAL units of an ``avcC`` record, as Annex B."""
    d = extradata or b""
    if len(d) < 7 or d[0] != 1:
        raise ForeignFileError(f"{where}: the H.264 stream has no avcC record (extradata of {len(d)} bytes)")
    out, i = [], 5
    for count_mask in (0x1F, 0xFF):  # SPS count (low 5 bits), then PPS count
        if i >= len(d):
            raise ForeignFileError(f"{where}: the avcC record is truncated")
        count = d[i] & count_mask
        i += 1
        for _ in range(count):
            size = int.from_bytes(d[i : i + 2], "big")
            if size == 0 or i + 2 + size > len(d):
                raise ForeignFileError(f"{where}: the avcC record is truncated")
            out += [b"\x00\x00\x00\x01", d[i + 2 : i + 2 + size]]
            i += 2 + size
    return b"".join(out)


def _open_container(av: Any, fileobj: Any, where: str) -> tuple[Any, Any]:
    try:
        c = av.open(fileobj, "r", format="mp4")
    except Exception as e:  # noqa: BLE001  # the file is input: whatever FFmpeg says about it
        raise ForeignFileError(f"{where}: not a readable MP4 ({type(e).__name__}: {e})") from None
    if not c.streams.video:
        c.close()
        raise ForeignFileError(f"{where}: the MP4 holds no video stream")
    return c, c.streams.video[0]


def _in_range(pts: Any, tb: Fraction, lo: float, hi: float, half: float) -> int:
    """-1 before ``[lo, hi)`` (times within half a frame), 0 inside, 1 past it."""
    t = float(pts * tb)
    return -1 if t < lo - half else (1 if t >= hi - half else 0)


def episode_frames(fileobj: Any, where: str, t0: float, t1: float, fps: float, length: int,
                   shape: tuple[int, int]) -> np.ndarray:
    """The ``length`` frames (length, H, W, 3) uint8 in ``[t0, t1)`` of the MP4 ``fileobj``, decoded.

    Raises
    ------
    ForeignFileError
        As :meth:`Mp4Index.episode`, or frames that do not decode.
    """
    av = av_module(where)
    c, s = _open_container(av, fileobj, where)
    h, w = shape
    out = np.empty((length, h, w, 3), np.uint8)
    n = 0
    try:
        cc = s.codec_context
        if (int(cc.height), int(cc.width)) != (h, w):
            raise ForeignFileError(f"{where}: frames are {cc.height}x{cc.width}; info.json declares {h}x{w}")
        tb, half = Fraction(s.time_base), 0.5 / fps
        if t0 > half:
            c.seek(int(max(t0 - 1.0, 0.0) / tb), stream=s, backward=True, any_frame=False)
        for fr in c.decode(s):
            pos = _in_range(fr.pts, tb, t0, t1, half)
            if pos < 0:
                continue
            if pos > 0:
                break
            if n >= length:
                raise ForeignFileError(f"{where}: more than the {length} frames its episode declares")
            out[n] = fr.to_ndarray(format="rgb24")
            n += 1
    except ForeignFileError:
        raise
    except Exception as e:  # noqa: BLE001  # the file is input
        raise ForeignFileError(f"{where}: the MP4 does not decode ({type(e).__name__}: {e})") from None
    finally:
        c.close()
    if n != length:
        raise ForeignFileError(f"{where}: {n} frames in [{t0:.4f}, {t1:.4f}) s; its episode declares {length} "
                               "(the MP4 is shorter than its episodes claim, or the timestamps are off)")
    return out


class Mp4Writer:
    """An MP4 of one camera, episodes appended one after another; :meth:`close` finishes the file.
    ``codec``: ``"av1"`` (libsvtav1, LeRobot's default: crf 30, g 2) or ``"h264"`` (libx264).

    Frames are held until :data:`PIECE_BYTES` of them are (or the file is closed), then encoded
    as one *piece* by a fresh encoder, each episode's first frame forced to a keyframe, and the
    packets muxed: a piece ends at an episode start when it can, else (an episode longer than a
    piece) on the keyframe interval of its episode, so every episode starts on a keyframe and the
    intervals run on from it as in one stream.  Pieces are encoded through a
    :class:`~trajstore.storage.fields.video_guard.GuardedEncoder` (AV1 in a child process under a
    watchdog: an encoder that hangs is killed and the piece encoded again, and
    :class:`~trajstore.errors.EncoderError` after three failures)."""

    def __init__(self, path: str, fps: float, shape: tuple[int, int], codec: str = "av1", crf: int | None = None,
                 gop: int = 2) -> None:
        av = av_module(f"export_lerobot: {path}")
        self.path, self.shape, self.gop = path, (int(shape[0]), int(shape[1])), gop
        self.codec = VideoCodec(codec, crf, gop, "yuv420p", "12" if codec == "av1" else "veryfast")
        self.rate = Fraction(fps).limit_denominator(1 << 16)
        self.c = av.open(path, "w", format="mp4")
        self.s = self.c.add_mux_stream(codec, rate=self.rate, width=self.shape[1], height=self.shape[0])
        self.av = av
        self.encoder = GuardedEncoder()
        self.piece = max(gop, PIECE_BYTES // (self.shape[0] * self.shape[1] * 3))
        self.held: list[np.ndarray] = []
        self.starts: list[int] = []  # held frames that start an episode
        self.n_held = 0
        self.offset = 0  # the first held frame's place in its episode
        self.frames = 0

    def add(self, frames: np.ndarray, new_episode: bool) -> None:
        """Append (n, H, W, 3) uint8 frames; with ``new_episode`` they start an episode (a keyframe).
        The array is held as it is until its piece is encoded: it must not change meanwhile."""
        if not len(frames):
            return
        if new_episode:
            if self.n_held and self.n_held + len(frames) > self.piece:
                self._encode(self.n_held)  # the piece ends where this episode starts
            self.starts.append(self.n_held)
        self.held.append(np.asarray(frames, np.uint8))  # held as given (not copied) until encoded
        self.n_held += len(frames)
        while self.n_held > self.piece:
            self._encode(self._cut())

    def _cut(self) -> int:
        """The most held frames, at most a piece, after which a frame on its episode's keyframe
        interval follows (the next piece's first frame, a keyframe, keeps the cadence)."""
        for k in range(self.piece, 0, -1):
            start = max((s for s in self.starts if s <= k), default=-self.offset)
            if k in self.starts or (k - start) % self.gop == 0:
                return k
        return self.piece

    def _encode(self, k: int) -> None:
        """Encode the first ``k`` held frames with a fresh encoder and mux their packets."""
        frames: list[np.ndarray] = []
        rest: list[np.ndarray] = []
        pos = 0
        for b in self.held:  # split the blocks at frame k (views, no copy)
            if pos + len(b) <= k:
                frames.append(b)
            elif pos >= k:
                rest.append(b)
            else:
                frames.append(b[: k - pos])
                rest.append(b[k - pos :])
            pos += len(b)
        start = max((s for s in self.starts if s <= k), default=-self.offset)
        keys = tuple(s for s in self.starts if 0 < s < k)
        self.held, self.n_held = rest, self.n_held - k
        self.offset = k - start if k not in self.starts else 0
        self.starts = [s - k for s in self.starts if s >= k]
        where = f"export_lerobot: {self.path}: frames {self.frames}..{self.frames + k - 1}"
        packets, flags = self.encoder.encode(self.codec, frames, where, keys, self.rate)
        tb = 1 / self.rate
        for i, (data, key) in enumerate(zip(packets, flags)):
            p = self.av.Packet(data)
            p.stream, p.time_base = self.s, tb
            p.pts = p.dts = self.frames + i
            p.is_keyframe = key
            self.c.mux(p)
        self.frames += k

    def close(self, finish: bool = True) -> None:
        """Encode the frames still held and finish the file (``finish=False``: drop them, stop the
        encoder and close the file as it is, to be removed)."""
        try:
            if finish and self.n_held:
                self._encode(self.n_held)
        finally:
            self.held, self.n_held = [], 0
            self.encoder.close()
            self.c.close()


class Mp4Index:
    """Where an MP4's video packets are: presentation ``times`` (float64 s), file ``pos`` and
    ``size`` (int64), ``keys`` (bool), in demux order; ``codec`` (trajstore's name or None) and
    ``headers`` (H.264: the SPS/PPS as Annex B).  ``fileobj`` stays open (packets are read at
    their offsets: ``os.pread`` on a local file, seek and read under a lock otherwise) until
    :meth:`close`."""

    __slots__ = ("codec", "fileobj", "headers", "keys", "lock", "pos", "size", "times", "where")

    def __init__(self, where: str, fileobj: Any, times: np.ndarray, pos: np.ndarray, size: np.ndarray,
                 keys: np.ndarray, codec: str | None, headers: bytes) -> None:
        self.where, self.fileobj, self.times, self.pos, self.size, self.keys = where, fileobj, times, pos, size, keys
        self.codec, self.headers = codec, headers
        self.lock = threading.Lock()

    def _read(self, offset: int, n: int) -> bytes:
        fd = getattr(self.fileobj, "fileno", None)
        if isinstance(self.fileobj, io.FileIO) and fd is not None:
            return os.pread(fd(), n, offset)
        with self.lock:
            self.fileobj.seek(offset)
            return bytes(self.fileobj.read(n))

    def range(self, t0: float, t1: float, fps: float) -> tuple[int, int]:
        """Packets ``[lo, hi)`` whose times lie in ``[t0, t1)`` (within half a frame)."""
        half = 0.5 / fps
        return int(np.searchsorted(self.times, t0 - half)), int(np.searchsorted(self.times, t1 - half))

    def adoptable(self, lo: int, hi: int) -> str:
        """Why packets ``[lo, hi)`` cannot be kept as a segment ("" when they can)."""
        if self.codec is None:
            return "its codec is not AV1 or H.264, or its packets are not in display order"
        return "" if hi > lo and self.keys[lo] else "the episode does not start on a keyframe"

    def _checked(self, t0: float, t1: float, fps: float, length: int) -> tuple[int, int]:
        """Packets ``[lo, hi)`` of the ``length`` frames in ``[t0, t1)``, once they can be kept."""
        lo, hi = self.range(t0, t1, fps)
        if hi - lo != length:
            raise ForeignFileError(f"{self.where}: {hi - lo} frames in [{t0:.4f}, {t1:.4f}) s; its episode declares "
                                   f"{length} (the MP4 is shorter than its episodes claim, or the timestamps are off)")
        why = self.adoptable(lo, hi)
        if why:
            raise ForeignFileError(f"{self.where}: frames [{t0:.4f}, {t1:.4f}) s cannot be read in place ({why}); "
                                   "import the dataset (import_lerobot re-encodes such episodes)")
        a, b = int(self.pos[lo]), int(self.pos[hi - 1] + self.size[hi - 1])
        if b - a > MAX_SEGMENT_BYTES or int(self.size[lo:hi].sum()) > MAX_SEGMENT_BYTES:
            raise ForeignFileError(f"{self.where}: an episode of {b - a} bytes of packets; more than trajstore reads")
        return lo, hi

    def episode(self, t0: float, t1: float, fps: float, length: int) -> tuple[list[bytes], list[bool]]:
        """The packets (display order, Annex B for H.264) and keyframe flags of the ``length``
        frames in ``[t0, t1)``, read at their offsets.

        Raises
        ------
        ForeignFileError
            Another frame count, or packets that cannot be kept as they are (:meth:`adoptable`),
            naming the file.
        """
        lo, hi = self._checked(t0, t1, fps, length)
        a, b = int(self.pos[lo]), int(self.pos[hi - 1] + self.size[hi - 1])
        blob = self._read(a, b - a)
        if len(blob) != b - a:
            raise ForeignFileError(f"{self.where}: the file ends before the packets its index names")
        packets, keys = [], []
        for p, s, k in zip(self.pos[lo:hi].tolist(), self.size[lo:hi].tolist(), self.keys[lo:hi].tolist()):
            data = blob[p - a : p - a + s]
            if self.codec == "h264":
                data = (self.headers if k else b"") + _avcc_to_annexb(data, self.where)
            packets.append(data)
            keys.append(bool(k))
        return packets, keys

    def segment(self, t0: float, t1: float, fps: float, length: int) -> PutData:
        """The trajstore segment (:func:`~trajstore.storage.fields.video.write_segment`) of the
        ``length`` frames in ``[t0, t1)``.  Where the packets are AV1 lying one after another in a
        local file (LeRobot's MP4s: one track, samples in order), the pieces ``[head,
        FileSpan(file, offset, bytes), frame table]``: the packets are copied file to file when the
        segment is written (:mod:`~trajstore.storage.spans`; this index's file must still be open
        then), never held here.  Otherwise the segment's bytes, assembled from :meth:`episode`.
        Raises as :meth:`episode`."""
        lo, hi = self._checked(t0, t1, fps, length)
        pos, size = self.pos[lo:hi], self.size[lo:hi]
        if self.codec != "av1" or (pos[1:] != pos[:-1] + size[:-1]).any():
            return write_segment(*self.episode(t0, t1, fps, length))
        head, tail = segment_frame(size, self.keys[lo:hi])
        a, n = int(pos[0]), int(size.sum())
        if isinstance(self.fileobj, io.FileIO):
            return [head, FileSpan(self.fileobj, a, n, self.where), tail]
        blob = self._read(a, n)
        if len(blob) != n:
            raise ForeignFileError(f"{self.where}: the file ends before the packets its index names")
        return head + blob + tail

    def in_place(self, t0: float, t1: float, fps: float, length: int) -> tuple[np.ndarray, ...] | None:
        """``(pos, size, keys)`` (int64, int64, bool; (length,) each) of the ``length`` frames in ``[t0,
        t1)`` when a linked segment can name them where they lie (AV1 packets of a local file, as
        they are); None otherwise (H.264 samples are rewritten, a remote file cannot be linked).
        Raises as :meth:`episode`."""
        lo, hi = self._checked(t0, t1, fps, length)
        if self.codec != "av1" or not isinstance(self.fileobj, io.FileIO):
            return None
        return self.pos[lo:hi], self.size[lo:hi], self.keys[lo:hi]

    def close(self) -> None:
        """Close the file."""
        self.fileobj.close()


def _agrees(table: SampleTable | None, first: Any, s: Any, tb: Fraction) -> bool:
    """``table`` (read from the ``moov`` box) is what the demuxer gives: its time base, its frame
    count and its first packet (time, position, size, keyframe)."""
    if table is None or first is None or first.pos is None or len(table.pos) > MAX_EPISODE_PACKETS * 64:
        return False
    return (tb == Fraction(1, table.timescale) and int(s.frames or 0) == len(table.pos)
            and (int(first.pts), int(first.pos), int(first.size), bool(first.is_keyframe))
            == (int(table.pts[0]), int(table.pos[0]), int(table.size[0]), bool(table.keys[0])))


def _demux(packets: Any, where: str) -> tuple[np.ndarray, ...]:
    """``(pts, pos, size, keys)`` of every non-empty packet of the demuxer's ``packets``."""
    times: list[int] = []
    pos: list[int] = []
    size: list[int] = []
    keys: list[bool] = []
    for p in packets:
        if p.size == 0 or p.pts is None:
            continue
        if p.pos is None or p.pos < 0 or len(times) >= MAX_EPISODE_PACKETS * 64:
            raise ForeignFileError(f"{where}: a packet without a file position, or too many packets")
        times.append(p.pts)
        pos.append(int(p.pos))
        size.append(int(p.size))
        keys.append(bool(p.is_keyframe))
    return (np.asarray(times, np.int64), np.asarray(pos, np.int64), np.asarray(size, np.int64),
            np.asarray(keys, bool))


def index_packets(fileobj: Any, where: str, shape: tuple[int, int] | None = None) -> Mp4Index:
    """The :class:`Mp4Index` of the MP4 ``fileobj`` (nothing decoded; the index keeps ``fileobj``
    open and closes it).  Where the file's sample table is plain (:func:`~.mp4_table.plain_table`:
    LeRobot's and FFmpeg's MP4s) and agrees with the demuxer's first packet and frame count, the
    index is that table (the ``moov`` box read, not the packets); otherwise the file is demuxed.

    Raises
    ------
    ForeignFileError
        Not an MP4 with a video stream, frames of another size than ``shape`` (H, W), packets
        with no position (naming the file).
    """
    av = av_module(where)
    table = plain_table(fileobj)
    try:
        fileobj.seek(0)
    except Exception as e:  # noqa: BLE001  # the file is input
        raise ForeignFileError(f"{where}: not a readable MP4 ({type(e).__name__}: {e})") from None
    c, s = _open_container(av, fileobj, where)
    try:
        cc = s.codec_context
        if shape is not None and (int(cc.height), int(cc.width)) != tuple(shape):
            raise ForeignFileError(f"{where}: frames are {cc.height}x{cc.width}; info.json declares "
                                   f"{shape[0]}x{shape[1]}")
        codec = ADOPTABLE.get(cc.name)
        headers = _avcc_headers(cc.extradata, where) if codec == "h264" else b""
        tb = Fraction(s.time_base)
        packets = c.demux(s)
        first = next((p for p in packets if p.size and p.pts is not None), None)
        if _agrees(table, first, s, tb):
            assert table is not None
            pts, pos, size, keys = table.pts, table.pos, table.size, table.keys
        else:
            pts, pos, size, keys = _demux(itertools.chain([first] if first is not None else [], packets), where)
    except ForeignFileError:
        raise
    except Exception as e:  # noqa: BLE001  # the file is input
        raise ForeignFileError(f"{where}: the MP4 does not demux ({type(e).__name__}: {e})") from None
    finally:
        c.close()
    t = pts * float(tb)  # one product, not a Fraction per packet
    if len(t) > 1 and not (np.diff(t) > 0).all():
        codec = None  # B-frames: demux order is not display order
    return Mp4Index(where, fileobj, t, pos, size, keys, codec, headers)
