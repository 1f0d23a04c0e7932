"""Per-frame image codecs (JPEG, WebP, AVIF, JPEG XL, PNG, JPEG 2000) as a zarr v3 codec.

An image field is a zarr v3 array whose chunks are ``sharding_indexed`` shards of one-frame inner
chunks, each inner chunk encoded by :class:`ImageCodec` (zarr name ``"trajstore.image"``).  A
random row therefore decodes one frame, never its neighbours, and any zarr-python reader opens
the array once this module is imported (importing it registers the codec; the ``zarr.codecs``
entry point of the installed package does the same without an import).

The codec's settings (``format``, ``level``, ``lossless``, ``planes``) are the array's metadata.
The formats and the functions they call are a fixed table here: nothing a store names is ever
imported.  imagecodecs (``pip install 'trajstore[images]'``) is imported on the first encode or
decode, so a store with image fields opens and checks without it; JPEG frames decode with
simplejpeg where it is installed (the same extra; :func:`jpeg_decoder`), else with imagecodecs.

Frames: ``(H, W)`` grey, ``(H, W, C)`` with ``C`` in 1 or 3 as pixels; ``(H, W, 4)`` (frame stacks,
or RGBA) and channel-first ``(C, H, W)`` stacks (``C <= 16``) as ``C`` grey planes, each encoded
alone (a frame is then ``u32 count, count x u32 sizes, the planes``).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.buffer import Buffer, NDBuffer
from zarr.core.common import JSON, parse_named_configuration
from zarr.registry import register_codec

from trajstore.errors import BadOptionError, MissingDependencyError

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec

__all__ = ["CODEC_NAME", "FORMATS", "JPEG_DECODERS", "ImageCodec", "codec_from_config", "image_codec_of",
           "jpeg_decoder", "parse_image_compressor", "register_numcodecs_jpeg2k", "set_jpeg_decoder", "unreadable_codec"]

#: The zarr v3 codec name of :class:`ImageCodec`.
CODEC_NAME = "trajstore.image"
#: Largest number of grey planes of a frame (channel-first stacks and ``(H, W, C)`` with ``C`` 2 or 4+).
MAX_PLANES = 16
_LEVEL = re.compile(r"^(\w+?)(-lossless)?(?::(\d{1,3}))?$")


@dataclass(frozen=True)
class Format:
    """What one image format holds and how it is called.

    Attributes
    ----------
    dtypes : tuple of str
        Pixel dtypes it holds.
    channels : tuple of int
        Channels of one encoded image (1: grey).
    lossy, lossless : bool
        Whether it has a lossy mode / a lossless mode.
    levels : tuple of int
        Allowed ``level`` range (quality for lossy formats, effort/zlib level for PNG).
    default_level : int or None
        Level of ``"<format>"`` without ``:level``.
    """

    dtypes: tuple[str, ...]
    channels: tuple[int, ...]
    lossy: bool
    lossless: bool
    levels: tuple[int, int]
    default_level: int | None


#: The formats, by the name used in ``compressor`` strings and in the metadata.
FORMATS: dict[str, Format] = {
    "jpeg": Format(("uint8",), (1, 3), True, False, (1, 100), 90),
    "webp": Format(("uint8",), (1, 3, 4), True, True, (0, 100), 90),
    "avif": Format(("uint8",), (1, 3, 4), True, False, (0, 100), 80),
    "jpegxl": Format(("uint8", "uint16"), (1, 3, 4), True, True, (0, 100), 90),
    "png": Format(("uint8", "uint16"), (1, 3, 4), False, True, (0, 9), None),
    "jpeg2k": Format(("uint8", "uint16"), (1, 3, 4), True, True, (1, 100), None),
}

_EXTRA = "pip install 'trajstore[images]'"


def _imagecodecs() -> Any:
    """The imagecodecs module, or MissingDependencyError naming the extra."""
    try:
        import imagecodecs
    except ImportError:
        raise MissingDependencyError(f"image codecs (JPEG, WebP, AVIF, JPEG XL, PNG, JPEG 2000) need imagecodecs: "
                                     f"{_EXTRA}") from None
    return imagecodecs


def _encoder(fmt: str, level: int | None, lossless: bool) -> Callable[[np.ndarray], bytes]:
    """A function encoding one image (2-D grey or (H, W, C)) in ``fmt`` with these settings."""
    ic = _imagecodecs()
    if fmt == "jpeg":
        return lambda a: ic.jpeg8_encode(a, level=level)
    if fmt == "webp":
        def webp(a: np.ndarray) -> bytes:
            if a.ndim == 2:  # libwebp holds RGB(A) only: a grey frame goes as three equal channels
                a = np.repeat(a[:, :, None], 3, axis=2)
            # Lossless: encoder method 0, the fastest (84x84 photos: 2.3 ms a frame against 58 ms at
            # libwebp's default method 4, for 7 % more bytes).
            return ic.webp_encode(a, level=None if lossless else level, lossless=lossless,
                                  method=0 if lossless else None)
        return webp
    if fmt == "avif":
        return lambda a: ic.avif_encode(a, level=level, speed=8)
    if fmt == "jpegxl":
        if lossless:
            return lambda a: ic.jpegxl_encode(a, lossless=True, effort=3)
        return lambda a: ic.jpegxl_encode(a, level=level, effort=3)
    if fmt == "png":
        return lambda a: ic.png_encode(a, level=level)
    if fmt == "jpeg2k":
        if lossless:
            return lambda a: ic.jpeg2k_encode(a, reversible=True)
        return lambda a: ic.jpeg2k_encode(a, level=level)
    raise BadOptionError(f"image format {fmt!r} is not one of {sorted(FORMATS)}")


#: The libraries that decode JPEG frames, the first installed one by default: simplejpeg (the
#: images extra's; libjpeg-turbo's TurboJPEG API, the GIL released around the header and the
#: decode) and imagecodecs (which encodes every JPEG frame).  Both run libjpeg-turbo with the same
#: settings (accurate integer IDCT, fancy upsampling): the same bytes decode to the same pixels.
JPEG_DECODERS = ("simplejpeg", "imagecodecs")
_jpeg_library: str | None = None  # set_jpeg_decoder; None: the first installed


def set_jpeg_decoder(library: str | None) -> None:
    """Decode JPEG frames with ``library`` (one of :data:`JPEG_DECODERS`; None: the first of them
    that is installed).  A process-wide setting, read as each batch starts decoding.

    Raises
    ------
    BadOptionError
        ``library`` names no JPEG decoder.
    MissingDependencyError
        ``library`` (or imagecodecs, which every image field needs) is not installed.
    """
    global _jpeg_library
    if library is not None and library not in JPEG_DECODERS:
        raise BadOptionError(f"JPEG decoder {library!r} is not one of {list(JPEG_DECODERS)} or None")
    jpeg_decoder(library)  # refuse a library that is not installed now, not at the next read
    _jpeg_library = library


def jpeg_decoder(library: str | None = None) -> Callable[[Any, np.ndarray], None]:
    """The function ``(data, out)`` decoding one JPEG image ``data`` (bytes-like) into ``out``
    (uint8, C-contiguous, ``(H, W)`` grey or ``(H, W, 3)`` RGB) with ``library`` (None: what
    :func:`set_jpeg_decoder` set, else the first installed of :data:`JPEG_DECODERS`).

    Both raise (ValueError or imagecodecs' error) for an image of another size than ``out`` (a
    larger one before decoding it).  Where they differ, on bytes trajstore never writes:
    imagecodecs refuses an image with another number of components than ``out`` holds, simplejpeg
    converts it (a grey JPEG into three equal channels, a colour one into its luma); and of damaged
    frames each refuses a few that the other decodes as libjpeg-turbo fills them (warnings pass in
    both: a truncated scan decodes).

    Raises MissingDependencyError where imagecodecs, or the library asked for, is not installed."""
    ic = _imagecodecs()
    library = library or _jpeg_library
    sj = None if library == "imagecodecs" else _simplejpeg()
    if sj is None:
        if library == "simplejpeg":
            raise MissingDependencyError(f"the JPEG decoder simplejpeg is not installed: {_EXTRA}")
        return _returned_out(ic.jpeg8_decode)
    decode = sj.decode_jpeg

    def dec(b: Any, out: np.ndarray) -> None:
        # Positional (the fastest call): colorspace, fastdct, fastupsample, min_height, min_width,
        # min_factor, buffer, strict (False: warnings pass, as imagecodecs lets them).  The buffer
        # must hold the image (else ValueError, before decoding); a smaller image is refused here.
        got = decode(b, "gray" if out.ndim == 2 else "rgb", False, False, 0, 0, 1.0, out, False)
        if got.shape[:2] != out.shape[:2]:
            raise ValueError(f"decoded shape {got.shape[:2]}; expected {out.shape[:2]}")
    return dec


def _simplejpeg() -> Any:
    """The simplejpeg module, or None where it is not installed."""
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _returned_out(fn: Callable[..., np.ndarray]) -> Callable[[Any, np.ndarray], None]:
    """``fn(data, out=out)`` (an imagecodecs decoder) with its result checked against ``out``."""
    def dec(b: Any, out: np.ndarray) -> None:
        got = fn(b, out=out)
        if got is not out:  # (imagecodecs returns ``out`` itself; else a view of it, or a fresh array)
            _settle(got, out)
    return dec


def _decoder(fmt: str) -> Callable[[Any, np.ndarray], None]:
    """A function decoding one encoded image into ``out`` (2-D grey or (H, W, C))."""
    ic = _imagecodecs()
    if fmt == "jpeg":
        return jpeg_decoder()
    if fmt == "webp":
        def webp(b: Any, out: np.ndarray) -> None:
            if out.ndim == 2:  # (into a buffer of the frame's size: a header never sizes an allocation)
                rgb = np.empty((*out.shape, 3), out.dtype)
                ic.webp_decode(b, out=rgb)
                out[:] = rgb[..., 0]
            else:
                ic.webp_decode(b, out=out)
        return webp
    return _returned_out({"avif": ic.avif_decode, "jpegxl": ic.jpegxl_decode, "png": ic.png_decode,
                          "jpeg2k": ic.jpeg2k_decode}[fmt])


def _settle(got: np.ndarray, out: np.ndarray) -> None:
    """Check a decoder's result ``got`` that is not ``out`` itself: the frame's shape, and copied
    into ``out`` unless it already lies there (ValueError for another shape)."""
    if got.shape != out.shape:
        raise ValueError(f"decoded shape {got.shape}; expected {out.shape}")
    if not np.shares_memory(got, out):
        out[:] = got


class ImageCodec(ArrayBytesCodec):
    """zarr v3 array-to-bytes codec encoding each chunk (one frame: ``(1, *row_shape)``) as an image.

    Parameters
    ----------
    format : str
        One of :data:`FORMATS`.
    level : int, optional
        Quality (lossy formats, 0-100) or compression level (PNG 0-9); None: the format's default.
    lossless : bool
        Lossless mode (PNG always; WebP, JPEG XL and JPEG 2000 on request).
    planes : int or None
        None: a frame is one image; -1 / 0: its last / first axis holds grey planes encoded alone.
    """

    is_fixed_size = False

    def __init__(self, format: str, level: int | None = None, lossless: bool = False, planes: int | None = None):
        fmt = FORMATS.get(format) if isinstance(format, str) else None
        if fmt is None:
            raise BadOptionError(f"image format {format!r} is not one of {sorted(FORMATS)}")
        if not isinstance(lossless, bool) or (lossless and not fmt.lossless) or (not lossless and not fmt.lossy):
            raise BadOptionError(f"{format} is {'lossless' if fmt.lossless else 'lossy'} only; got lossless={lossless!r}")
        if level is None and not lossless:
            level = fmt.default_level
        if level is not None and (type(level) is not int or not fmt.levels[0] <= level <= fmt.levels[1]):
            raise BadOptionError(f"{format} level must be an int in {fmt.levels[0]}..{fmt.levels[1]}; got {level!r}")
        if planes not in (None, -1, 0):
            raise BadOptionError(f"planes must be None, -1 or 0; got {planes!r}")
        self.format, self.level, self.lossless, self.planes = format, level, lossless, planes
        self._enc: Callable[[np.ndarray], bytes] | None = None
        self._dec: Callable[[Any, np.ndarray], None] | None = None
        self._dec_for: str | None = None  # the set_jpeg_decoder setting _dec was made under

    def __repr__(self) -> str:
        return f"ImageCodec({self.format!r}, level={self.level}, lossless={self.lossless}, planes={self.planes})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageCodec) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.format, self.level, self.lossless, self.planes))

    @property
    def label(self) -> str:
        """Short text of the settings, as a ``compressor`` string: ``"jpeg:90"``, ``"webp-lossless"``."""
        return self.format + ("-lossless" if self.lossless and FORMATS[self.format].lossy else "") + (
            f":{self.level}" if self.level is not None else "")

    # -- zarr's codec interface ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        """The codec a ``zarr.json`` names (``{"name": "trajstore.image", "configuration": {...}}``).

        Raises ValueError (zarr's convention for codec metadata) on unknown keys or settings."""
        _, cfg = parse_named_configuration(data, CODEC_NAME)
        keys = {"format", "level", "lossless", "planes"}
        if set(cfg) - keys or "format" not in cfg:
            raise ValueError(f"{CODEC_NAME} configuration {cfg!r}; expected the keys {sorted(keys)}")
        try:
            return cls(**cfg)  # type: ignore[arg-type]
        except BadOptionError as e:
            raise ValueError(str(e)) from None

    def to_dict(self) -> dict[str, JSON]:
        """The codec's ``zarr.json`` entry: its name and its four settings."""
        return {"name": CODEC_NAME, "configuration": {"format": self.format, "level": self.level,
                                                     "lossless": self.lossless, "planes": self.planes}}

    def validate(self, *, shape: tuple[int, ...], dtype: Any, chunk_grid: Any) -> None:
        """zarr's check at array creation: the frame shape ``shape[1:]`` and dtype must fit the format."""
        native = dtype.to_native_dtype() if hasattr(dtype, "to_native_dtype") else np.dtype(dtype)
        self.check(tuple(shape[1:]), np.dtype(native))

    def compute_encoded_size(self, input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        """Not known ahead: an encoded frame's size depends on its content (zarr then asks no size)."""
        raise NotImplementedError  # variable size

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        out = np.empty(chunk_spec.shape, dtype=chunk_spec.dtype.to_native_dtype())
        if out.shape[0] != 1:
            raise ValueError(f"{CODEC_NAME} decodes one frame per chunk; got a chunk of {out.shape[0]}")
        self.decode_into(chunk_bytes.as_numpy_array(), out[0])
        return chunk_spec.prototype.nd_buffer.from_ndarray_like(out)  # type: ignore[arg-type]

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        a = chunk_array.as_numpy_array()
        if a.shape[0] != 1:
            raise ValueError(f"{CODEC_NAME} encodes one frame per chunk; got a chunk of {a.shape[0]}")
        return chunk_spec.prototype.buffer.from_bytes(self.encode_frame(a[0]))

    # -- one frame -------------------------------------------------------------------------------
    def check(self, row_shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Refuse a row shape or dtype this codec cannot hold, naming what it can (BadOptionError)."""
        fmt = FORMATS[self.format]
        if dtype.name not in fmt.dtypes:
            raise BadOptionError(f"{self.format} holds {' or '.join(fmt.dtypes)} frames; got {dtype.name} "
                                 f"(frames of other dtypes: a lossless compressor such as 'zstd')")
        ok = {None: len(row_shape) == 2 or (len(row_shape) == 3 and row_shape[2] in fmt.channels and row_shape[2] != 4),
              -1: len(row_shape) == 3 and 1 <= row_shape[2] <= MAX_PLANES,
              0: len(row_shape) == 3 and 1 <= row_shape[0] <= MAX_PLANES}[self.planes]
        if self.planes is None and len(row_shape) == 3 and row_shape[2] == 4 and 4 in fmt.channels:
            ok = True  # RGBA asked for explicitly (planes=None on a codec object)
        if not ok or 0 in row_shape:
            raise BadOptionError(f"{self.label} frames are (H, W), (H, W, C) with C in 1, 3 (as pixels), (H, W, C) "
                                 f"or (C, H, W) with C <= {MAX_PLANES} (as grey planes); got row shape {row_shape} "
                                 f"with planes={self.planes}")

    def encode_frame(self, frame: np.ndarray) -> bytes:
        """One frame (``row_shape``) encoded."""
        if self._enc is None:
            self._enc = _encoder(self.format, self.level, self.lossless)
        enc = self._enc
        if self.planes is None:
            return enc(np.ascontiguousarray(frame[..., 0] if frame.ndim == 3 and frame.shape[2] == 1 else frame))
        planes = np.moveaxis(frame, self.planes, 0)
        blobs = [enc(np.ascontiguousarray(p)) for p in planes]
        return struct.pack(f"<I{len(blobs)}I", len(blobs), *map(len, blobs)) + b"".join(blobs)

    def frame_decoder(self, row_shape: tuple[int, ...]) -> Callable[[Any, np.ndarray], None]:
        """The function ``(data, out)`` that decodes one encoded frame ``data`` (bytes-like) into
        ``out`` (``row_shape``, C-contiguous), as :meth:`decode_into` does, with the fewest Python
        steps: where a frame is one image the format decodes as it is (``planes`` None, not ``(H, W,
        1)``), the library's call and a check of what it returned (:func:`jpeg_decoder` for JPEG),
        else :meth:`decode_into`.  What the decode threads call per frame: each step here holds the
        GIL that the other threads wait for between their frames (an 84x84 frame decodes in 25-40 us).

        Raises MissingDependencyError without imagecodecs."""
        if self.planes is not None or (len(row_shape) == 3 and row_shape[2] == 1):
            return self.decode_into
        return self._decoder()

    def _decoder(self) -> Callable[[Any, np.ndarray], None]:
        """The format's decoder, made again where :func:`set_jpeg_decoder` changed since."""
        if self._dec is None or self._dec_for != _jpeg_library:
            self._dec, self._dec_for = _decoder(self.format), _jpeg_library
        return self._dec

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        """Decode one encoded frame ``data`` (bytes-like) into ``out`` (``row_shape``, C-contiguous).

        Raises whatever the codec raises on garbage (callers turn it into DamagedStoreError)."""
        dec = self._dec
        if dec is None or self._dec_for != _jpeg_library:
            dec = self._decoder()
        if self.planes is None:
            dec(data, out[..., 0] if out.ndim == 3 and out.shape[2] == 1 else out)
            return
        buf = memoryview(data).cast("B")
        n = out.shape[self.planes]
        if len(buf) < 4 + 4 * n or struct.unpack_from("<I", buf, 0)[0] != n:
            raise ValueError(f"a frame of {n} planes does not start with its plane table")
        sizes = struct.unpack_from(f"<{n}I", buf, 4)
        pos = 4 + 4 * n
        if pos + sum(sizes) != len(buf):
            raise ValueError(f"plane sizes {sizes} do not add up to the frame's {len(buf)} bytes")
        contiguous = self.planes == 0
        tmp = None if contiguous else np.empty(out.shape[:2], out.dtype)
        for i, s in enumerate(sizes):
            dest = out[i] if contiguous else tmp
            assert dest is not None
            dec(buf[pos : pos + s], dest)
            if not contiguous:
                out[..., i] = dest
            pos += s


def default_planes(row_shape: tuple[int, ...]) -> int | None:
    """Planes layout for a row shape: pixels for (H, W) and (H, W, 1|3); grey planes along the last
    axis for (H, W, C) with other C; along the first for channel-first stacks (C, H, W)."""
    if len(row_shape) == 3:
        if row_shape[2] in (1, 3):
            return None
        if row_shape[2] <= MAX_PLANES:
            return -1
        if row_shape[0] <= MAX_PLANES:
            return 0
    return None


def parse_image_compressor(compressor: Any, row_shape: tuple[int, ...], dtype: np.dtype) -> ImageCodec | None:
    """The :class:`ImageCodec` that ``compressor`` names, checked against the frames it will hold;
    None when it names no image format (``None``, ``"lz4"``, a bytes codec...).

    Strings: ``"<format>"``, ``"<format>:<level>"``, ``"<format>-lossless"`` (formats with both
    modes).  A codec object is taken as it is.

    Raises
    ------
    BadOptionError
        A malformed string or level, or frames the format cannot hold (the message lists what it can).
    MissingDependencyError
        imagecodecs is not installed (naming the extra).
    """
    if isinstance(compressor, ImageCodec):
        codec = compressor
    elif isinstance(compressor, str):
        m = _LEVEL.match(compressor)
        if m is None or m.group(1) not in FORMATS:
            return None
        fmt, lossless, level = m.group(1), bool(m.group(2)), m.group(3)
        if fmt == "png" or (fmt == "jpeg2k" and level is None):
            lossless = True
        codec = ImageCodec(fmt, None if level is None else int(level), lossless, default_planes(row_shape))
    else:
        return None
    codec.check(tuple(row_shape), np.dtype(dtype))
    _imagecodecs()  # refuse at create, not at the first flush
    return codec


def image_codec_of(codecs: Any) -> ImageCodec | None:
    """The :class:`ImageCodec` of an image field's zarr codecs (``metadata.codecs``: one
    ``sharding_indexed`` codec whose inner codec is an ImageCodec), else None."""
    from zarr.codecs import ShardingCodec

    if len(codecs) == 1 and isinstance(codecs[0], ShardingCodec) and len(codecs[0].codecs) == 1:
        inner = codecs[0].codecs[0]
        return inner if isinstance(inner, ImageCodec) else None
    return None


def codec_from_config(cfg: Any) -> ImageCodec:
    """The codec of a stored ``{"name": "trajstore.image", "configuration": ...}`` entry (ValueError
    when it is not one this version knows)."""
    if not isinstance(cfg, dict) or cfg.get("name") != CODEC_NAME:
        raise ValueError(f"not a {CODEC_NAME} codec: {cfg!r}")
    return ImageCodec.from_dict(cfg)


def register_numcodecs_jpeg2k() -> bool:
    """Register imagecodecs' numcodecs JPEG 2000 codec (id ``imagecodecs_jpeg2k``: what Diffusion
    Policy's real-robot datasets compress their frames with) so zarr reads such arrays; False when
    imagecodecs is not installed.  A fixed codec, never one a file names."""
    try:
        from imagecodecs.numcodecs import Jpeg2k
    except ImportError:
        return False
    import numcodecs

    numcodecs.register_codec(Jpeg2k)
    return True


def unreadable_codec(e: Exception, where: str) -> Exception | None:
    """The trajstore error for zarr's ``UnknownCodecError`` ``e`` while opening the foreign arrays
    at ``where``: MissingDependencyError naming the extra for an imagecodecs codec when imagecodecs
    is missing, else BadValueError naming the codec; None for any other exception."""
    from numcodecs.errors import UnknownCodecError

    from trajstore.errors import BadValueError

    if not isinstance(e, UnknownCodecError):
        return None
    if "imagecodecs_" in str(e) and not register_numcodecs_jpeg2k():
        return MissingDependencyError(f"{where}: its arrays are compressed with imagecodecs ({e}): {_EXTRA}")
    return BadValueError(f"{where}: an array names a codec trajstore does not read ({e}); expected numcodecs' "
                         "built-in codecs or imagecodecs' JPEG 2000")


register_codec(CODEC_NAME, ImageCodec)
