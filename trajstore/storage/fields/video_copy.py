"""What a key-by-key copy of a store (``copy_to``: ``trajstore copy``, ``dumps``; ``push``) writes
for a video field's files: a linked segment (:mod:`.video_pack`) as the plain segment of its
packets (:func:`linked_copy`), so a copy holds its own packets and no pack.
"""

from __future__ import annotations

import os

import numpy as np

from trajstore.errors import DamagedStoreError
from trajstore.storage.confined import pread
from trajstore.storage.fields.video import plain_bytes
from trajstore.storage.fields.video_pack import LINK_MAGIC, open_linked
from trajstore.storage.location import Location

__all__ = ["linked_copy", "plain_segment"]


def linked_copy(loc: Location, key: str) -> bytes | None:
    """What a key-by-key copy writes under ``key`` when it is a linked segment
    (:func:`plain_segment`: the plain segment of its packets); None for any other key (copied as
    it is).  A pack (:func:`~.video_pack.is_pack_key`) is never copied: no copy needs it."""
    head, _, lo = key.rpartition("/video/")
    if not head or not lo.isdigit():
        return None
    if loc.is_local:
        try:
            fd = loc.open_inside(key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            if pread(fd, len(LINK_MAGIC), 0) != LINK_MAGIC:
                return None
        finally:
            os.close(fd)
    data = loc.get(key)
    return None if data is None or data[: len(LINK_MAGIC)] != LINK_MAGIC else plain_segment(loc, key, data)


def plain_segment(loc: Location, key: str, data: bytes) -> bytes:
    """``data``, the bytes stored under the segment key ``key`` (``<field>/video/<lo>``), as a copy
    writes them: a linked segment as the plain segment of its packets (checked against their
    crc32c; DamagedStoreError naming the key otherwise), anything else unchanged."""
    if data[: len(LINK_MAGIC)] != LINK_MAGIC:
        return data
    rows, rest = divmod(len(data) - 52, 24)
    array_path = key.rpartition("/video/")[0]
    try:
        if rest or rows < 0:
            raise ValueError(f"{len(data)} bytes are no linked segment (size)")
        return plain_bytes(open_linked(loc, array_path, np.frombuffer(data, np.uint8), rows, f"{loc.url}: {key}"))
    except ValueError as e:
        raise DamagedStoreError(f"{loc.url}: {key}: a damaged linked video segment ({e})") from None
