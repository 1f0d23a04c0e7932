"""Frames as PNG or JPEG thumbnails, made on demand for ``trajstore view`` (through imagecodecs)."""

from __future__ import annotations

import numpy as np

from trajstore.errors import BadOptionError, MissingDependencyError

__all__ = ["encode_frame", "thumbnail", "FORMATS", "MAX_SIDE"]

#: Formats a frame is served in (PNG: lossless, the stored pixels; JPEG: small).
FORMATS = {"png": "image/png", "jpeg": "image/jpeg"}
#: Largest thumbnail side asked for (0 asks for the frame as stored).
MAX_SIDE = 4096


def thumbnail(frame: np.ndarray, size: int) -> np.ndarray:
    """``frame`` (H, W[, C]) shrunk by an integer stride so its longer side is at most ``size``
    (nearest pixel: cheap, and a pixel shown is a pixel stored); ``size`` 0 keeps it whole."""
    if size < 0 or size > MAX_SIDE:
        raise BadOptionError(f"size must be 0 (the frame as stored) .. {MAX_SIDE}; got {size}")
    side = max(frame.shape[:2])
    if size == 0 or side <= size:
        return frame
    k = -(-side // size)
    return frame[::k, ::k]


def encode_frame(frame: np.ndarray, fmt: str, quality: int = 85) -> bytes:
    """``frame`` (H, W) or (H, W, C) uint8, C in 1, 3, 4, as PNG or JPEG bytes (JPEG drops alpha).

    Raises
    ------
    BadOptionError
        An unknown format.
    MissingDependencyError
        imagecodecs is not installed (the ``view`` extra).
    """
    if fmt not in FORMATS:
        raise BadOptionError(f"fmt must be one of {sorted(FORMATS)}; got {fmt!r}")
    try:
        import imagecodecs
    except ImportError:
        raise MissingDependencyError("trajstore view serves frames through imagecodecs: "
                                     "pip install 'trajstore[view]'") from None
    a = np.ascontiguousarray(frame)
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if fmt == "png":
        return bytes(imagecodecs.png_encode(a))
    if a.ndim == 3 and a.shape[2] == 4:
        a = np.ascontiguousarray(a[:, :, :3])
    return bytes(imagecodecs.jpeg8_encode(a, level=quality))
