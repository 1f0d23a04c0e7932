"""Codecs of ``trajstore copy`` field by field: ``--compressor cam=h264,depth=png,*=keep``.

A copy that names fields writes each of them with its own codec (a per-frame image codec, a video
codec, lz4/zstd, ``none`` for raw, ``keep`` for the source's); fields it does not name keep the
source's codec (or take ``*``'s).  So a raw or per-frame field becomes a video field (episodes as
segments, as a recorder writes them), and a video field becomes per-frame frames or raw rows.

What the copy keeps as it is stored is passed as its bytes: image frames in the same codec
(:meth:`ImageField.frames_as_encoded <trajstore.storage.fields.image.ImageField.frames_as_encoded>`)
and video segments of the same settings (:meth:`VideoField.adopt
<trajstore.storage.fields.video.VideoField.adopt>`): a lossy frame is never encoded twice.  A field
transcoded into a lossy codec cannot equal its source: the copy's check compares it by PSNR
(reported) instead of bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import re
from typing import Any

import numpy as np

from trajstore.storage.fields.image import ImageField
from trajstore.storage.fields.spec import check_compressor_keys, field_compressor
from trajstore.storage.fields.video import VideoField

__all__ = ["KEYWORDS", "adopt_segments", "check_keys", "copy_compressor_arg", "field_choice", "lossy_fields",
           "source_codec"]

#: ``--compressor`` values that name no codec but a rule for every field.
KEYWORDS = ("auto", "keep", "none", "lz4", "zstd")
#: One ``FIELD=CODEC`` item: the field part has no ``:`` (a codec's settings ``h264:crf=20`` do).
_ITEM = re.compile(r"([^=:,\s]+)=([^,\s]+)")


def copy_compressor_arg(text: str) -> str | dict[str, str]:
    """``--compressor``'s argparse type: a keyword (:data:`KEYWORDS`), one codec for every field
    (``zstd``, ``jpeg:90``...), or comma-separated ``FIELD=CODEC`` items (a dict; ``*`` names
    every other field, which otherwise keeps its codec)."""
    items = text.split(",")
    found = [_ITEM.fullmatch(it) for it in items]
    if all(found):
        out = {m.group(1): m.group(2) for m in found if m is not None}
        if len(out) != len(items):
            raise argparse.ArgumentTypeError(f"{text!r} names a field twice")
        return out
    if len(items) == 1 and text.strip():
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected one of {', '.join(KEYWORDS)}, a codec (jpeg:90, png, h264, "
                                     f"av1...), or FIELD=CODEC items separated by commas (cam=h264,*=keep)")


def source_codec(store: Any, path: str) -> Any:
    """The bytes-to-bytes codec of a source array (None for raw), reusable at create."""
    z = store.group[path]
    codecs = [c for c in z.metadata.codecs if c.to_dict()["name"] != "bytes"]
    return codecs[0] if codecs else None


def _kept(store: Any, f: Any) -> Any:
    """What a copy that keeps field ``f``'s codec gives ``create``: its image codec or video
    settings, else its array's bytes codec."""
    if isinstance(f, (ImageField, VideoField)):
        return f.codec
    return source_codec(store, f.spec.array_path)


def field_choice(store: Any, f: Any, compressor: dict[str, Any]) -> Any:
    """The ``create`` compressor of the copy of source field ``f`` under the per-field
    ``compressor`` (unnamed fields: ``*``'s, else ``keep``)."""
    choice = field_compressor({**compressor, "*": compressor.get("*", "keep")}, f.spec.array_path)
    if choice in ("keep", "auto"):
        return _kept(store, f)
    return None if choice in ("none", None) else choice


def check_keys(store: Any, compressor: dict[str, Any]) -> None:
    """Refuse (BadOptionError, listing the fields) a key that names no field of ``store``."""
    check_compressor_keys(compressor, [f.spec.array_path for t in store.tables.values() for f in t.fields])


def adopt_segments(steps: Any, dst_fields: list[Any]) -> int:
    """Before the source step table ``steps``' committed rows are appended, in order, to a new
    store whose step fields are ``dst_fields``: each video segment of a source field that the copy
    keeps with the same settings is stored as its bytes (one segment per run of whole rows).
    Returns the segments adopted."""
    theirs = {g.spec.array_path: g for g in dst_fields if isinstance(g, VideoField)}
    pairs = [(f, g) for f in steps.fields
             if isinstance(f, VideoField) and (g := theirs.get(f.spec.array_path)) is not None and f.codec == g.codec]
    if not pairs or not steps.count:
        return 0
    phys = np.asarray(steps.physical(np.arange(steps.count, dtype=np.int64)), np.int64)
    n = 0
    for f, g in pairs:
        for a, c in f.segments_within(int(phys[0]), int(phys[-1]) + 1):
            i = int(np.searchsorted(phys, a))
            if i + c - a <= len(phys) and phys[i] == a and phys[i + c - a - 1] == c - 1:
                g.adopt(i, c - a, functools.partial(f.segment_bytes, a, c))
                n += 1
    return n


def lossy_fields(src: Any, dst: Any) -> dict[str, str]:
    """``{array path: codec label}`` of the copy's fields encoded anew by a lossy codec (video, or a
    lossy image codec other than the source field's): they are compared by PSNR, not bit for bit."""
    out: dict[str, str] = {}
    for name, dt in dst.tables.items():
        st = src.tables.get(name)
        mine = {f.spec.array_path: f for f in (st.fields if st is not None else [])}
        for g in dt.fields:
            lossy = isinstance(g, VideoField) or (isinstance(g, ImageField) and not g.codec.lossless)
            f = mine.get(g.spec.array_path)
            if lossy and not (f is not None and type(f) is type(g) and f.codec == g.codec):
                out[g.spec.array_path] = g.codec.label
    return out
