"""``VideoCodec``: the settings of a video field and its encoder/decoder (PyAV, which bundles FFmpeg).

A video field keeps a run of consecutive frames (an episode, :mod:`.video`) as one encoded stream:
raw packets, one per frame in display order (B-frames off, so decode order is display order),
each keyframe carrying its own stream headers (H.264 SPS/PPS, AV1 sequence header), so a frame
decodes from the keyframe before it with a fresh decoder.

Encoders in PyAV 18.1's bundled FFmpeg 8.1 (checked with ``av.codec.Codec(name, "w")``):
``libx264`` (H.264), ``libsvtav1`` (AV1), ``libx265`` (HEVC, not offered); no ``libopenh264``,
``libaom-av1`` or ``librav1e``.  Decoders: FFmpeg's own ``h264`` and ``libdav1d`` (AV1; FFmpeg's
native ``av1`` decoder needs a hardware accelerator).

Settings strings: ``"h264"``, ``"av1"``, ``"lerobot"`` (LeRobot v3's defaults: libsvtav1, crf 30,
g 2, yuv420p), each optionally followed by ``:key=value`` parts: ``crf`` (0-51 H.264, 0-63 AV1),
``g`` (keyframe interval, frames), ``preset`` (x264's names / SVT-AV1's 0-13) and ``pix_fmt``
(``yuv420p``; for H.264 also ``yuv444p`` (RGB) and ``gray`` (grey frames, its default there)).
Video is lossy: it is chosen only by naming it.

Frames (uint8): ``(H, W, 3)`` RGB, coded in ``pix_fmt``; grey ``(H, W)`` and ``(H, W, 1)``, and
frame stacks of ``C <= 16`` grey planes, ``(H, W, C)`` (``C`` not 1 or 3) or channel-first
``(C, H, W)``, as the per-frame codecs lay them out (:func:`.image_codecs.default_planes`): the
planes one above the other as one ``(C*H, W)`` grey picture, the luma of the stream (``gray`` for
H.264 by default, 4:0:0; ``yuv420p`` with flat chroma for AV1, which libsvtav1 codes in 4:2:0
only).  A grey picture of odd height or width is coded one pixel bigger (its last row / column
repeated) and cropped when decoded; the luma plane is read as it decodes, with no colour
conversion.  The planes layout is the setting ``planes`` (absent: pixels; -1: the last axis;
0: the first), stored with the others.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any, Union

import numpy as np

from trajstore.errors import BadOptionError, EncoderError, MissingDependencyError
from trajstore.storage.fields.image_codecs import MAX_PLANES, default_planes
from trajstore.storage.fields.video_worker import encode_stream

__all__ = ["VIDEO_ATTR", "VIDEO_CODECS", "Frames", "VideoCodec", "as_blocks", "codec_from_attrs", "load_av",
           "parse_video_compressor"]

#: The zarr array attribute holding a video field's settings (:meth:`VideoCodec.to_dict`).
VIDEO_ATTR = "trajstore_video"
#: codec -> (encoder, decoder, crf range, default crf, default g, default preset, pixel formats)
VIDEO_CODECS: dict[str, tuple[str, str, tuple[int, int], int, int, str, tuple[str, ...]]] = {
    "h264": ("libx264", "h264", (0, 51), 23, 10, "veryfast", ("yuv420p", "yuv444p", "gray")),
    "av1": ("libsvtav1", "libdav1d", (0, 63), 30, 2, "10", ("yuv420p",)),
}
_PRESETS = {"lerobot": ("av1", {"crf": 30, "g": 2, "pix_fmt": "yuv420p"})}
#: Speed presets each encoder takes (checked at create: a wrong one would fail only when the first
#: episode is encoded).
ENCODER_PRESETS: dict[str, tuple[str, ...]] = {
    "h264": ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
             "placebo"),
    "av1": tuple(str(i) for i in range(14)),
}
_KEY = re.compile(r"^(crf|g|preset|pix_fmt)=([A-Za-z0-9_]{1,16})$")
#: Pixel formats of a decoded frame whose first plane is 8-bit luma (a grey picture's pixels).
_LUMA8 = frozenset({"gray", "yuv420p", "yuvj420p", "yuv422p", "yuvj422p", "yuv444p", "yuvj444p"})
#: Largest side of a coded picture, pixels.
MAX_SIDE = 8192
_EXTRA = "video fields need PyAV: pip install 'trajstore[video]'"


#: Frames to encode: one (n, \\*row_shape) uint8 array, or a list of them (blocks, one after another).
Frames = Union[np.ndarray, Sequence[np.ndarray]]


def as_blocks(frames: Frames) -> list[np.ndarray]:
    """``frames`` (:data:`Frames`) as a list of blocks."""
    return [frames] if isinstance(frames, np.ndarray) else list(frames)


def load_av() -> Any:
    """The ``av`` module (PyAV), or MissingDependencyError naming the ``video`` extra."""
    return _av()


def _av() -> Any:
    """The ``av`` module, or MissingDependencyError naming the ``video`` extra."""
    try:
        import av
    except ImportError:
        raise MissingDependencyError(_EXTRA) from None
    return av


class VideoCodec:
    """How a video field encodes its frames.

    Parameters
    ----------
    codec : str
        ``"h264"`` (libx264) or ``"av1"`` (libsvtav1, decoded by libdav1d).
    crf : int, optional
        Constant rate factor (lower: better and bigger); None: 23 (H.264), 30 (AV1).
    gop : int, optional
        Keyframe interval in frames (a random frame decodes at most ``gop`` frames); None: 10
        (H.264), 2 (AV1, LeRobot's choice).
    pix_fmt : str
        ``"yuv420p"`` (RGB frames: even heights and widths) or, for H.264, ``"yuv444p"`` (RGB frames)
        or ``"gray"`` (grey frames and stacks: 4:0:0).
    preset : str, optional
        Encoder speed preset; None: ``"veryfast"`` (x264), ``"10"`` (SVT-AV1).
    planes : int or None
        None: a frame is pixels (``(H, W, 3)`` RGB, ``(H, W)`` / ``(H, W, 1)`` grey); -1 / 0: its last
        / first axis holds grey planes, coded one above the other as one grey picture.  A string
        compressor sets it from the row shape (:func:`parse_video_compressor`).
    """

    def __init__(self, codec: str, crf: int | None = None, gop: int | None = None, pix_fmt: str = "yuv420p",
                 preset: str | None = None, planes: int | None = None):
        if codec not in VIDEO_CODECS:
            raise BadOptionError(f"video codec {codec!r} is not one of {sorted(VIDEO_CODECS)}")
        _enc, _dec, (lo, hi), dcrf, dg, dpreset, pix = VIDEO_CODECS[codec]
        crf = dcrf if crf is None else crf
        gop = dg if gop is None else gop
        if type(crf) is not int or not lo <= crf <= hi:
            raise BadOptionError(f"{codec} crf must be an int in {lo}..{hi}; got {crf!r}")
        if type(gop) is not int or not 1 <= gop <= 1024:
            raise BadOptionError(f"keyframe interval g must be an int in 1..1024; got {gop!r}")
        if pix_fmt not in pix:
            raise BadOptionError(f"{codec} pixel format must be one of {list(pix)}; got {pix_fmt!r}")
        preset = dpreset if preset is None else preset
        if not isinstance(preset, str) or preset not in ENCODER_PRESETS[codec]:
            raise BadOptionError(f"{codec} preset must be one of {list(ENCODER_PRESETS[codec])}; got {preset!r}")
        if planes not in (None, -1, 0) or isinstance(planes, bool):
            raise BadOptionError(f"planes must be None, -1 or 0; got {planes!r}")
        self.codec, self.crf, self.gop, self.pix_fmt, self.preset = codec, crf, gop, pix_fmt, preset
        self.planes = planes

    def __repr__(self) -> str:
        return f"VideoCodec({self.codec!r}, crf={self.crf}, gop={self.gop}, pix_fmt={self.pix_fmt!r}, " \
               f"preset={self.preset!r}, planes={self.planes})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VideoCodec) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.to_dict().values()))

    @property
    def label(self) -> str:
        """The settings as a ``compressor`` string: ``"h264:crf=23:g=10:pix_fmt=yuv420p:preset=veryfast"``."""
        return f"{self.codec}:crf={self.crf}:g={self.gop}:pix_fmt={self.pix_fmt}:preset={self.preset}"

    def to_dict(self) -> dict[str, Any]:
        """The settings as stored in the field's zarr attributes (:data:`VIDEO_ATTR`); ``planes``
        only when a frame is a stack of planes (stores of pixel frames keep the five keys)."""
        out: dict[str, Any] = {"codec": self.codec, "crf": self.crf, "gop": self.gop, "pix_fmt": self.pix_fmt,
                               "preset": self.preset}
        if self.planes is not None:
            out["planes"] = self.planes
        return out

    # -- the picture a frame is coded as -----------------------------------------------------------
    def is_grey(self, row_shape: tuple[int, ...]) -> bool:
        """Whether frames of ``row_shape`` are coded as one grey picture (all but RGB ``(H, W, 3)`` pixels)."""
        return not (self.planes is None and len(row_shape) == 3 and row_shape[2] == 3)

    def picture(self, row_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(height, width)`` of the picture a frame is: ``(H, W)``, or ``(C*H, W)`` for C planes."""
        if self.planes is None:
            return int(row_shape[0]), int(row_shape[1])
        c = int(row_shape[self.planes])
        h, w = (row_shape[0], row_shape[1]) if self.planes == -1 else (row_shape[1], row_shape[2])
        return c * int(h), int(w)

    def coded(self, row_shape: tuple[int, ...]) -> tuple[int, int]:
        """``(height, width)`` of the coded picture: a grey one rounded up to even sides."""
        h, w = self.picture(row_shape)
        return (h + h % 2, w + w % 2) if self.is_grey(row_shape) else (h, w)

    def _to_picture(self, frame: np.ndarray) -> np.ndarray:
        """One frame as its grey picture (padded to the coded size by repeating the last row / column)."""
        h, w = self.picture(frame.shape)
        pic = (np.moveaxis(frame, -1, 0) if self.planes == -1 else frame).reshape(h, w)
        ch, cw = self.coded(frame.shape)
        return np.pad(pic, ((0, ch - h), (0, cw - w)), mode="edge") if (ch, cw) != (h, w) else pic

    def _from_picture(self, pic: np.ndarray, out: np.ndarray) -> None:
        """Write grey picture ``pic`` (cropped to :meth:`picture`) into the frame ``out``."""
        if self.planes is None:
            out[...] = pic.reshape(out.shape)
        elif self.planes == -1:
            out[...] = pic.reshape(out.shape[2], out.shape[0], out.shape[1]).transpose(1, 2, 0)
        else:
            out[...] = pic.reshape(out.shape)

    def check(self, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Refuse frames this codec cannot hold (BadOptionError naming what it can)."""
        n = len(row_shape)
        shape_ok = min(row_shape, default=0) > 0 and {
            None: n == 2 or (n == 3 and row_shape[2] in (1, 3)),
            -1: n == 3 and row_shape[2] <= MAX_PLANES,
            0: n == 3 and row_shape[0] <= MAX_PLANES}[self.planes]
        if shape_ok:
            grey = self.is_grey(row_shape)
            h, w = self.coded(row_shape)
            shape_ok = max(h, w) <= MAX_SIDE and (grey or self.pix_fmt != "yuv420p" or (h % 2 == 0 and w % 2 == 0))
            if shape_ok and grey != (self.pix_fmt == "gray") and self.pix_fmt != "yuv420p":
                use = "gray or yuv420p" if grey and self.codec == "h264" else "yuv420p"
                raise BadOptionError(f"video ({self.label}): pixel format {self.pix_fmt} is for "
                                     f"{'RGB' if self.pix_fmt == 'yuv444p' else 'grey'} frames; frames {row_shape} are "
                                     f"{'grey' if grey else 'RGB'} (use {use})")
        if np.dtype(dtype) != np.uint8 or not shape_ok:
            raise BadOptionError(f"video ({self.label}) holds uint8 RGB frames (H, W, 3) (H and W even with yuv420p), "
                                 f"grey frames (H, W) or (H, W, 1), and frame stacks of C <= {MAX_PLANES} grey planes "
                                 f"(H, W, C) or (C, H, W) (coded one above the other: a (C*H, W) grey picture); "
                                 f"every side at most {MAX_SIDE} pixels; got {row_shape} {np.dtype(dtype).name}"
                                 f"{'' if self.planes is None else f' with planes={self.planes}'} (other frames: a "
                                 f"per-frame image codec such as 'png')")

    # -- encoding and decoding -----------------------------------------------------------------
    def job(self, row_shape: tuple[int, ...], n: int, keys: tuple[int, ...] = (),
            rate: Fraction = Fraction(30)) -> dict[str, Any]:
        """The encoding settings for ``n`` frames of ``row_shape`` as :func:`.video_worker.encode_stream`
        takes them (JSON-able): FFmpeg's encoder, coded size, pixel format, keyframe interval,
        options, the pictures it is fed (``src``: ``rgb24`` (H, W, 3), ``gray`` (H, W) or
        ``yuv420p`` (H*3/2, W) with flat chroma; ``shape``), one per frame (:meth:`sources`), and
        the frames ``keys`` forced to keyframes, at ``rate`` frames per second (a field's episodes:
        30)."""
        ch, cw = self.coded(row_shape)
        if not self.is_grey(row_shape):
            src, shape = "rgb24", [ch, cw, 3]
        elif self.pix_fmt == "gray":  # 4:0:0: the picture is the luma
            src, shape = "gray", [ch, cw]
        else:  # the picture as luma, chroma flat (no colour conversion: the luma is coded as it is)
            src, shape = "yuv420p", [ch * 3 // 2, cw]
        return {"encoder": VIDEO_CODECS[self.codec][0], "width": cw, "height": ch, "pix_fmt": self.pix_fmt,
                "gop": self.gop, "options": {"crf": str(self.crf), "preset": self.preset}, "src": src,
                "shape": shape, "frames": int(n), "keys": [int(k) for k in keys],
                "rate": f"{rate.numerator}/{rate.denominator}"}

    def sources(self, frames: Frames) -> Iterator[np.ndarray]:
        """Each of ``frames`` (:data:`Frames`) as the contiguous picture the encoder is fed
        (:meth:`job`'s ``src`` and ``shape``); a grey picture in 4:2:0 reuses one buffer."""
        blocks = as_blocks(frames)
        row_shape = tuple(blocks[0].shape[1:]) if blocks else ()
        if not blocks or not self.is_grey(row_shape):
            for b in blocks:
                yield from (np.ascontiguousarray(f) for f in b)
            return
        ch, cw = self.coded(row_shape)
        i420 = np.full((ch * 3 // 2, cw), 128, np.uint8) if self.pix_fmt == "yuv420p" else None
        for f in (f for b in blocks for f in b):
            if i420 is None:
                yield np.ascontiguousarray(self._to_picture(f))
            else:
                i420[:ch] = self._to_picture(f)
                yield i420

    def encode(self, frames: Frames, keys: tuple[int, ...] = (),
               rate: Fraction = Fraction(30)) -> tuple[list[bytes], list[bool]]:
        """``frames`` (:data:`Frames`, n in all) as n packets (display order) and their keyframe
        flags, encoded in this process (:mod:`.video_guard` encodes in a child process under a
        watchdog); ``keys``: frames forced to keyframes besides the first; ``rate``: frames per
        second.

        Raises
        ------
        MissingDependencyError
            PyAV is not installed.
        EncoderError
            The encoder gave a packet count other than n (it would break the frame index).
        """
        av = _av()
        blocks = as_blocks(frames)
        n = sum(len(b) for b in blocks)
        got = list(encode_stream(av, self.job(tuple(blocks[0].shape[1:]), n, keys, rate), self.sources(blocks)))
        if len(got) != n:
            raise EncoderError(f"{VIDEO_CODECS[self.codec][0]} gave {len(got)} packets for {n} frames")
        return [p for p, _ in got], [k for _, k in got]

    def decode(self, packets: list[Any], n: int, dest: dict[int, list[int]], out: np.ndarray) -> None:
        """Decode ``packets`` (bytes-like, the first a keyframe; ``n`` of them) with a fresh decoder,
        one frame at a time: frame ``i`` goes to ``out[p]`` for each ``p`` of ``dest.get(i, [])``
        (``out``: (B, \\*row_shape) uint8).

        Raises ValueError (or what FFmpeg raises) when the packets do not give exactly ``n`` frames
        of ``out``'s frame shape; callers turn it into DamagedStoreError."""
        av = _av()
        ctx = av.CodecContext.create(VIDEO_CODECS[self.codec][1], "r")
        row_shape = tuple(out.shape[1:])
        grey = self.is_grey(row_shape)
        h, w = self.coded(row_shape)
        ph, pw = self.picture(row_shape)
        # A stream announcing bigger frames fails inside FFmpeg before it allocates them (the coded
        # size is padded: H.264 to 16-pixel macroblocks, AV1 to 8; 64 bounds both).
        ctx.options = {"max_pixels": str(-(-h // 64) * 64 * (-(-w // 64) * 64))}
        i = 0

        def frame_of(fr: Any) -> np.ndarray:
            """The decoded frame in ``row_shape`` (RGB), or its cropped luma (grey); checked."""
            if not grey:
                a = fr.to_ndarray(format="rgb24")
                if a.shape != row_shape or a.dtype != out.dtype:
                    raise ValueError(f"a decoded frame is {a.shape} {a.dtype}; expected {row_shape} {out.dtype}")
                return a
            if fr.format.name not in _LUMA8:
                raise ValueError(f"a decoded frame is {fr.format.name}; expected 8-bit luma ({sorted(_LUMA8)})")
            plane = fr.planes[0]
            y = np.frombuffer(memoryview(plane), np.uint8)
            if plane.line_size < w or len(y) < plane.line_size * h:
                raise ValueError(f"a decoded luma plane of {len(y)} bytes ({plane.line_size} a line) cannot hold "
                                 f"{h}x{w} pixels")
            return y[: plane.line_size * h].reshape(h, plane.line_size)[:ph, :pw]

        def take(frames: Any) -> None:
            nonlocal i
            for fr in frames:
                if i >= n:
                    raise ValueError(f"the packets decode to more than their {n} frames")
                if (fr.height, fr.width) != (h, w):
                    raise ValueError(f"a decoded frame is {fr.height}x{fr.width}; the field's frames are {h}x{w}")
                ps = dest.get(i)
                if ps:
                    a = frame_of(fr)
                    for p in ps:
                        if grey:
                            self._from_picture(a, out[p])
                        else:
                            out[p] = a
                i += 1

        for p in packets:
            take(ctx.decode(av.Packet(p)))
        take(ctx.decode(None))
        if i != n:
            raise ValueError(f"the packets decode to {i} frames; expected {n}")


def parse_video_compressor(compressor: Any, row_shape: tuple[int, ...], dtype: np.dtype) -> VideoCodec | None:
    """The :class:`VideoCodec` that ``compressor`` names, checked against the frames it will hold;
    None when it names no video codec.

    Strings: ``"h264"``, ``"av1"``, ``"lerobot"``, optionally with ``:crf=..``, ``:g=..``,
    ``:preset=..``, ``:pix_fmt=..`` parts; a :class:`VideoCodec` is taken as it is.

    Raises
    ------
    BadOptionError
        A malformed setting, or frames the codec cannot hold.
    MissingDependencyError
        PyAV is not installed (naming the ``video`` extra).
    """
    planes = default_planes(tuple(row_shape))
    if isinstance(compressor, VideoCodec):
        codec = compressor
        if codec.planes is None and planes is not None:  # a stack: its planes, as a string would say
            codec = VideoCodec(codec.codec, codec.crf, codec.gop, codec.pix_fmt, codec.preset, planes)
    elif isinstance(compressor, str):
        name, *parts = compressor.split(":")
        if name not in VIDEO_CODECS and name not in _PRESETS:
            return None
        base, preset = _PRESETS.get(name, (name, {}))
        kw: dict[str, Any] = dict(preset)
        for part in parts:
            m = _KEY.match(part)
            if m is None:
                raise BadOptionError(f"video setting {part!r} of {compressor!r}: expected crf=<int>, g=<int>, "
                                     f"preset=<word> or pix_fmt=<name>")
            k, v = m.groups()
            kw[k] = int(v) if k in ("crf", "g") and v.isdigit() else v
        grey = len(row_shape) != 3 or row_shape[2] != 3 or planes is not None
        pix = kw.get("pix_fmt", "gray" if grey and base == "h264" else "yuv420p")  # H.264 codes grey as 4:0:0
        codec = VideoCodec(base, kw.get("crf"), kw.get("g"), pix, kw.get("preset"), planes)
    else:
        return None
    codec.check(tuple(row_shape), np.dtype(dtype))
    _av()  # refuse at create, not at the first episode's end
    return codec


def codec_from_attrs(cfg: Any) -> VideoCodec:
    """The codec of a stored :data:`VIDEO_ATTR` entry (ValueError when it is not one this version
    knows: the attributes are input)."""
    keys = {"codec", "crf", "gop", "pix_fmt", "preset"}
    if not isinstance(cfg, dict) or set(cfg) - {"planes"} != keys:
        raise ValueError(f"{VIDEO_ATTR} {cfg!r}: expected the keys {sorted(keys)} (and planes)")
    if "planes" in cfg and (cfg["planes"] is None or isinstance(cfg["planes"], bool)):
        raise ValueError(f"{VIDEO_ATTR} planes {cfg['planes']!r}: expected -1 or 0")
    try:
        return VideoCodec(cfg["codec"], cfg["crf"], cfg["gop"], cfg["pix_fmt"], cfg["preset"], cfg.get("planes"))
    except BadOptionError as e:
        raise ValueError(str(e)) from None
