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
(``yuv420p``; ``yuv444p`` for H.264).  Video is lossy: it is chosen only by naming it.
"""

from __future__ import annotations

import os
import re
from fractions import Fraction
from typing import Any

import numpy as np

from trajstore.errors import BadOptionError, MissingDependencyError

__all__ = ["VIDEO_ATTR", "VIDEO_CODECS", "VideoCodec", "codec_from_attrs", "parse_video_compressor"]

#: The zarr array attribute holding a video field's settings (:meth:`VideoCodec.to_dict`).
VIDEO_ATTR = "trajstore_video"
#: codec -> (encoder, decoder, crf range, default crf, default g, default preset, pixel formats)
VIDEO_CODECS: dict[str, tuple[str, str, tuple[int, int], int, int, str, tuple[str, ...]]] = {
    "h264": ("libx264", "h264", (0, 51), 23, 10, "veryfast", ("yuv420p", "yuv444p")),
    "av1": ("libsvtav1", "libdav1d", (0, 63), 30, 2, "10", ("yuv420p",)),
}
_PRESETS = {"lerobot": ("av1", {"crf": 30, "g": 2, "pix_fmt": "yuv420p"})}
_KEY = re.compile(r"^(crf|g|preset|pix_fmt)=([A-Za-z0-9_]{1,16})$")
_EXTRA = "video fields need PyAV: pip install 'trajstore[video]'"


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
        ``"yuv420p"`` (even heights and widths) or, for H.264, ``"yuv444p"``.
    preset : str, optional
        Encoder speed preset; None: ``"veryfast"`` (x264), ``"10"`` (SVT-AV1).
    """

    def __init__(self, codec: str, crf: int | None = None, gop: int | None = None, pix_fmt: str = "yuv420p",
                 preset: str | None = None):
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
        if not isinstance(preset, str) or not re.fullmatch(r"[A-Za-z0-9_]{1,16}", preset):
            raise BadOptionError(f"preset must be a short word (x264: 'veryfast'..., SVT-AV1: '0'..'13'); got {preset!r}")
        self.codec, self.crf, self.gop, self.pix_fmt, self.preset = codec, crf, gop, pix_fmt, preset

    def __repr__(self) -> str:
        return f"VideoCodec({self.codec!r}, crf={self.crf}, gop={self.gop}, pix_fmt={self.pix_fmt!r}, " \
               f"preset={self.preset!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VideoCodec) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(self.to_dict().values()))

    @property
    def label(self) -> str:
        """The settings as a ``compressor`` string: ``"h264:crf=23:g=10:pix_fmt=yuv420p:preset=veryfast"``."""
        return f"{self.codec}:crf={self.crf}:g={self.gop}:pix_fmt={self.pix_fmt}:preset={self.preset}"

    def to_dict(self) -> dict[str, Any]:
        """The settings as stored in the field's zarr attributes (:data:`VIDEO_ATTR`)."""
        return {"codec": self.codec, "crf": self.crf, "gop": self.gop, "pix_fmt": self.pix_fmt, "preset": self.preset}

    def check(self, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Refuse frames this codec cannot hold (BadOptionError naming what it can)."""
        shape_ok = len(row_shape) == 3 and row_shape[2] == 3 and min(row_shape) > 0 and max(row_shape[:2]) <= 8192
        even = self.pix_fmt != "yuv420p" or (len(row_shape) == 3 and row_shape[0] % 2 == 0 and row_shape[1] % 2 == 0)
        if np.dtype(dtype) != np.uint8 or not shape_ok or not even:
            raise BadOptionError(f"video ({self.label}) holds uint8 RGB frames (H, W, 3) with H, W <= 8192"
                                 f"{', both even (yuv420p)' if self.pix_fmt == 'yuv420p' else ''}; got {row_shape} "
                                 f"{np.dtype(dtype).name} (other frames: a per-frame image codec such as 'png')")

    # -- encoding and decoding -----------------------------------------------------------------
    def encode(self, frames: np.ndarray) -> tuple[list[bytes], list[bool]]:
        """``frames`` (n, H, W, 3) uint8 as n packets (display order) and their keyframe flags.

        Raises
        ------
        MissingDependencyError
            PyAV is not installed.
        RuntimeError
            The encoder gave a packet count other than n (it would break the frame index).
        """
        av = _av()
        enc_name, *_ = VIDEO_CODECS[self.codec]
        if self.codec == "av1":
            os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr unless told not to
        ctx = av.CodecContext.create(enc_name, "w")
        ctx.width, ctx.height = int(frames.shape[2]), int(frames.shape[1])
        ctx.pix_fmt, ctx.time_base, ctx.framerate = self.pix_fmt, Fraction(1, 30), Fraction(30)
        ctx.gop_size, ctx.max_b_frames = self.gop, 0  # no B-frames: packet i is frame i
        ctx.options = {"crf": str(self.crf), "preset": self.preset}
        packets = []
        for i, f in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24").reformat(format=self.pix_fmt)
            vf.pts = i
            packets += ctx.encode(vf)
        packets += ctx.encode(None)
        if len(packets) != len(frames):
            raise RuntimeError(f"{enc_name} gave {len(packets)} packets for {len(frames)} frames")
        return [bytes(p) for p in packets], [bool(p.is_keyframe) for p in packets]

    def decode(self, packets: list[Any], n: int, dest: dict[int, list[int]], out: np.ndarray) -> None:
        """Decode ``packets`` (bytes-like, the first a keyframe; ``n`` of them) with a fresh decoder,
        one frame at a time: frame ``i`` goes to ``out[p]`` for each ``p`` of ``dest.get(i, [])``.

        Raises ValueError (or what FFmpeg raises) when the packets do not give exactly ``n`` frames
        of ``out``'s frame shape; callers turn it into DamagedStoreError."""
        av = _av()
        ctx = av.CodecContext.create(VIDEO_CODECS[self.codec][1], "r")
        h, w = out.shape[1:3]
        # A stream announcing bigger frames fails inside FFmpeg before it allocates them (the coded
        # size is padded: H.264 to 16-pixel macroblocks, AV1 to 8; 64 bounds both).
        ctx.options = {"max_pixels": str(-(-h // 64) * 64 * (-(-w // 64) * 64))}
        i = 0

        def take(frames: Any) -> None:
            nonlocal i
            for fr in frames:
                if i >= n:
                    raise ValueError(f"the packets decode to more than their {n} frames")
                if (fr.height, fr.width) != (h, w):
                    raise ValueError(f"a decoded frame is {fr.height}x{fr.width}; the field's frames are {h}x{w}")
                ps = dest.get(i)
                if ps:
                    a = fr.to_ndarray(format="rgb24")
                    if a.shape != out.shape[1:] or a.dtype != out.dtype:
                        raise ValueError(f"a decoded frame is {a.shape} {a.dtype}; expected {out.shape[1:]} {out.dtype}")
                    for p in ps:
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
    if isinstance(compressor, VideoCodec):
        codec = compressor
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
        codec = VideoCodec(base, kw.get("crf"), kw.get("g"), kw.get("pix_fmt", "yuv420p"), kw.get("preset"))
    else:
        return None
    codec.check(tuple(row_shape), np.dtype(dtype))
    _av()  # refuse at create, not at the first episode's end
    return codec


def codec_from_attrs(cfg: Any) -> VideoCodec:
    """The codec of a stored :data:`VIDEO_ATTR` entry (ValueError when it is not one this version
    knows: the attributes are input)."""
    keys = {"codec", "crf", "gop", "pix_fmt", "preset"}
    if not isinstance(cfg, dict) or set(cfg) != keys:
        raise ValueError(f"{VIDEO_ATTR} {cfg!r}: expected the keys {sorted(keys)}")
    try:
        return VideoCodec(cfg["codec"], cfg["crf"], cfg["gop"], cfg["pix_fmt"], cfg["preset"])
    except BadOptionError as e:
        raise ValueError(str(e)) from None
