"""Rows of raw chunks fetched as byte ranges (:class:`~trajstore.storage.fields.chunked.ChunkedField`
on an icechunk location).

A raw chunk (codecs: ``bytes`` alone) holds its rows one after another, so rows ``a .. b`` of it are
bytes ``a * row_bytes .. b * row_bytes``: a reader that wants a run of rows of a chunk (a pull of
some episodes, a scan) fetches that run alone instead of the whole chunk.  Reading 10% of the
episodes of a store then transfers about 10% of its bytes whatever its chunking (issue 33); a
checksummed read fetches the 64 KiB blocks around the run (:mod:`trajstore.storage.icechunk_store`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import RangeByteRequest
from zarr.codecs import BytesCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from trajstore.storage.location import GET_CONCURRENCY, Location

__all__ = ["raw_dtype", "get_ranges", "dense_runs"]


def raw_dtype(z: zarr.Array[Any]) -> np.dtype | None:
    """The dtype (byte order as stored) of the rows in ``z``'s chunks when its codecs are one
    ``bytes`` codec (a raw chunk: rows one after another, C order); None otherwise."""
    try:
        codecs = z.metadata.codecs  # type: ignore[union-attr]  # zarr v2 metadata has none: below
    except AttributeError:
        return None
    if len(codecs) != 1 or not isinstance(codecs[0], BytesCodec):
        return None
    dtype = np.dtype(z.dtype)
    endian = getattr(codecs[0].endian, "value", codecs[0].endian)  # None for one-byte dtypes
    if endian is None:
        return dtype if dtype.itemsize == 1 else None
    return dtype.newbyteorder("<" if endian == "little" else ">")


def get_ranges(loc: Location, wants: list[tuple[str, int, int]], stats: dict[str, int] | None = None,
               concurrency: int = GET_CONCURRENCY) -> list[bytes | None]:
    """Bytes ``[a, b)`` of each ``(key, a, b)`` of ``wants``, fetched concurrently (up to
    ``concurrency`` at once); None for a key that is absent.  ``stats["gets"]`` counts requests."""
    proto = default_buffer_prototype()

    async def one(sem: asyncio.Semaphore, key: str, a: int, b: int) -> bytes | None:
        async with sem:
            buf = await loc.zstore.get(key, prototype=proto, byte_range=RangeByteRequest(a, b))
        return None if buf is None else buf.to_bytes()

    async def every() -> list[bytes | None]:
        sem = asyncio.Semaphore(concurrency)
        return list(await asyncio.gather(*(one(sem, *w) for w in wants)))

    if stats is not None:
        stats["gets"] = stats.get("gets", 0) + len(wants)
    return sync(every())


def dense_runs(phys: np.ndarray, ks: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """``(chunk, lo, hi, positions)`` for every chunk of ``ks`` whose wanted rows (``phys`` at
    ``positions``) fill at least half of their span ``[lo, hi)``: a run worth one ranged fetch.
    Sparse rows (a random batch) are left out: their chunks are fetched whole and cached."""
    order = np.argsort(ks, kind="stable")
    sk, sp = ks[order], phys[order]
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    ends = np.r_[starts[1:], len(sk)]
    out = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        rows = sp[s:e]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        if 2 * (e - s) >= hi - lo:
            out.append((int(sk[s]), lo, hi, order[s:e]))
    return out
