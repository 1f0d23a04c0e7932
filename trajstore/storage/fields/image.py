"""``ImageField``: a field of image frames, one encoded frame per zarr inner chunk.

The array's chunks are ``sharding_indexed`` shards (:mod:`.image_codecs`): the frames' bytes, then
an index of ``(offset, nbytes)`` u64 pairs (one per row, ``2**64-1`` twice for a row never written)
and its crc32c.  A random row is read by looking its frame up in the shard's index (the file is
memory-mapped locally, fetched elsewhere; the index is checked once per shard) and decoding that
frame alone; the frames of a batch decode on a bounded thread pool (:func:`decode_threads`) into
one preallocated array.  The codecs release the GIL, so threads add up: the calling thread and the
pool's threads take the batch's frames one at a time from one shared iterator (:func:`parallel`),
so they finish together, and a thread's only GIL-held work per frame is a few lines and the codec
call's own Python steps (:meth:`ImageCodec.frame_decoder`).  An 84x84 frame decodes in 25-40 us:
each GIL-held microsecond is one the other threads may wait for, woken late by the OS.

The writer keeps each frame it has encoded: a flush encodes only the rows written since (on the
same pool) and writes the shard whole (temp file + rename, as every chunk), so committed frames
are never encoded twice (a lossy codec would lose quality each time).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import google_crc32c
import numpy as np
import zarr

from trajstore.errors import BadOptionError, DamagedStoreError, TrajstoreError
from trajstore.storage.confined import full_disk
from trajstore.storage.fields.base import edit_chunk
from trajstore.storage.fields.chunked import ENCODED_BYTES, MAX_ENCODED, ChunkedField, cached_split
from trajstore.storage.fields.image_codecs import image_codec_of
from trajstore.storage.fields.out import new_rows, temporary_rows
from trajstore.storage.fields.spec import FieldSpec, chunk_key
from trajstore.storage.location import Location

__all__ = ["ImageField", "decode_threads", "parallel", "set_decode_threads", "share_decode_threads"]

T = TypeVar("T")
_MISSING = np.uint64(2**64 - 1)
#: Items per thread below which fewer threads run (a pool hand-off costs ~20-50 us).
_MIN_PER_THREAD = 2
#: ``sys.setswitchinterval`` while threads decode (None: leave it).  A thread that finds the GIL
#: taken sleeps until it is handed over, and CPython hands it over by force only after the switch
#: interval (5 ms): a codec takes the GIL back between its steps, so a thread whose wake-up came
#: late could wait through many frames of the other's (84x84 JPEG renders on idle cores, 2 threads
#: against 1, medians of runs: 1.68-1.77x at 5 ms, 1.71-1.83x at 0.2 ms; docs/performance-notes.md).
#: Process-wide while any batch decodes on more than one thread, then the previous value again.
DECODE_SWITCH_INTERVAL: float | None = 2e-4

# -- the decode pool ----------------------------------------------------------------------------
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_threads: int | None = None  # set_decode_threads; None: the default
_share: tuple[int, int] | None = None  # share_decode_threads: (pid, processes sharing the CPUs)
_switch: list[float] = []  # the interval before the first batch now decoding set ours, while any runs
_switch_users = 0


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return max(1, os.cpu_count() or 1)


def decode_threads() -> int:
    """Threads that decode (and encode) image frames: what :func:`set_decode_threads` set, else the
    environment variable ``TRAJSTORE_DECODE_THREADS``, else the CPUs this process may run on
    (``os.sched_getaffinity``), divided among the processes that share them when
    :func:`share_decode_threads` said so (a DataLoader worker: ``max(1, cpus // num_workers)``)."""
    if _threads is not None:
        return _threads
    env = os.environ.get("TRAJSTORE_DECODE_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return min(int(env), 256)
    share = _share[1] if _share is not None and _share[0] == os.getpid() else 1
    return max(1, _cpus() // share)


def share_decode_threads(processes: int) -> None:
    """Make this process's default decode threads its share of the CPUs: ``max(1, cpus //
    processes)`` (what a DataLoader worker calls with ``num_workers``: the workers together then
    decode on about one thread per CPU instead of each on every CPU).  Only the default changes:
    :func:`set_decode_threads` and ``TRAJSTORE_DECODE_THREADS`` still win; a process forked from
    this one starts from the full default again."""
    global _share
    if type(processes) is not int or processes < 1:
        raise BadOptionError(f"processes must be an int >= 1; got {processes!r}")
    _share = (os.getpid(), processes)


def set_decode_threads(n: int | None) -> None:
    """Decode image frames on ``n`` threads (1: in the calling thread only; None: the default of
    :func:`decode_threads`).  A process-wide setting, also for DataLoader workers forked later."""
    global _threads
    if n is not None and (type(n) is not int or not 1 <= n <= 256):
        raise BadOptionError(f"decode threads must be an int in 1..256 or None; got {n!r}")
    _threads = n


def _get_pool(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(n, thread_name_prefix="trajstore-decode"), n
        return _pool


def _forget_pool() -> None:
    """In a forked child the parent's pool threads do not exist: start a new pool when needed."""
    global _pool, _pool_size, _lock, _switch_users
    _pool, _pool_size, _lock = None, 0, threading.Lock()
    if _switch_users:  # forked while a batch decoded: that batch does not go on here
        _switch_users = 0
        sys.setswitchinterval(_switch.pop())


if hasattr(os, "register_at_fork"):  # no fork on Windows
    os.register_at_fork(after_in_child=_forget_pool)


def parallel(fn: Callable[[Iterable[T]], None], items: Sequence[T]) -> None:
    """``fn`` on each decode thread (the first is the calling thread), all of them iterating over
    one shared iterator of ``items``: each thread takes the next item when it is done with one, so
    the threads finish together whatever each item costs and whenever a pool thread wakes (one task
    per thread, not per item).  ``fn`` must do each item it is given, in any thread and order.

    The first exception raised is raised here, after every thread has stopped (the items not yet
    taken are then dropped)."""
    n = min(decode_threads(), max(1, len(items) // _MIN_PER_THREAD))
    if n <= 1:
        fn(items)
        return
    shared = iter(items)  # (a list's iterator hands each item out once, under the GIL)

    def each(_: int) -> None:
        try:
            fn(shared)
        except BaseException:
            deque(shared, maxlen=0)  # the other threads stop at their next item
            raise

    pool = _get_pool(n - 1)
    with _short_switch_interval():
        futures = [pool.submit(each, i) for i in range(1, n)]
        error: BaseException | None = None
        try:
            each(0)
        except BaseException as e:
            error = e
        for f in futures:
            error = error or f.exception()
    if error is not None:
        raise error


@contextlib.contextmanager
def _short_switch_interval() -> Iterator[None]:
    """:data:`DECODE_SWITCH_INTERVAL` while the block runs; the interval found before the first of
    the blocks running at once is set again when the last of them ends (unless someone else changed
    it meanwhile)."""
    global _switch_users
    want = DECODE_SWITCH_INTERVAL
    if want is None:
        yield
        return
    with _lock:
        if _switch_users == 0:
            _switch[:] = [sys.getswitchinterval()]
            sys.setswitchinterval(want)
        _switch_users += 1
    try:
        yield
    finally:
        with _lock:
            _switch_users -= 1
            if _switch_users == 0 and _switch and abs(sys.getswitchinterval() - want) < 1e-6:
                sys.setswitchinterval(_switch.pop())


# -- shards -------------------------------------------------------------------------------------
class _Shard:
    """One shard file's bytes and its checked index: ``offsets``/``sizes`` (C,) int64, -1 where
    the row was never written (``offs``/``lens``: the same as memoryviews, whose items the decode
    threads read per frame for less than ``ndarray.item`` costs)."""

    __slots__ = ("buf", "lens", "offs", "offsets", "owner", "sizes", "view")

    def __init__(self, buf: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, owner: object):
        self.buf, self.offsets, self.sizes, self.owner = buf, offsets, sizes, owner
        self.view = memoryview(buf.data)  # (sliced per frame: cheaper than an array slice)
        self.offs, self.lens = offsets.data, sizes.data

    def frame(self, i: int) -> np.ndarray | None:
        o = int(self.offsets[i])
        return None if o < 0 else self.buf[o : o + int(self.sizes[i])]


def read_index(buf: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and sizes (int64, -1: empty row) of the ``rows`` frames of shard ``buf`` (uint8),
    after checking the index's crc32c and that every frame lies inside the shard before the index.

    Raises ValueError naming what is wrong."""
    n, ib = len(buf), 16 * rows
    if n < ib + 4:
        raise ValueError(f"{n} bytes cannot hold an index of {rows} frames")
    idx = buf[n - ib - 4 : n - 4]
    if google_crc32c.value(idx.tobytes()) != int.from_bytes(buf[n - 4 :].tobytes(), "little"):
        raise ValueError("the shard index checksum does not match")
    pairs = idx.view("<u8").reshape(rows, 2)
    empty = (pairs[:, 0] == _MISSING) & (pairs[:, 1] == _MISSING)
    end = np.uint64(n - ib - 4)
    bad = ~empty & ((pairs[:, 0] > end) | (pairs[:, 1] > end - np.minimum(pairs[:, 0], end)) | (pairs[:, 1] == 0))
    if bad.any():
        raise ValueError(f"the index places frame {int(np.flatnonzero(bad)[0])} outside the shard")
    offsets = np.where(empty, -1, pairs[:, 0].astype(np.int64))
    return offsets, np.where(empty, 0, pairs[:, 1].astype(np.int64))


def write_shard(frames: Sequence[bytes]) -> bytes:
    """A shard of ``frames`` (``b""``: a row never written) as zarr's ``sharding_indexed`` lays it out
    with the index at the end (``bytes`` little-endian, then ``crc32c``)."""
    index = np.full((len(frames), 2), _MISSING, dtype="<u8")
    pos = 0
    for i, f in enumerate(frames):
        if f:
            index[i] = (pos, len(f))
            pos += len(f)
    ib = index.tobytes()
    return b"".join(frames) + ib + google_crc32c.value(ib).to_bytes(4, "little")


class ImageField(ChunkedField):
    """A field of frames encoded one by one (a :class:`~trajstore.storage.fields.base.Field`)."""

    def __init__(self, loc: Location, spec: FieldSpec, zarray: zarr.Array[Any], writable: bool):
        super().__init__(loc, spec, zarray, writable)
        codec = image_codec_of(zarray.metadata.codecs)  # type: ignore[union-attr]  # checked (array_meta) before opening
        if codec is None:
            raise DamagedStoreError(f"{loc.url}: {spec.array_path}: image layout without a trajstore.image codec")
        self.codec = codec
        self._shards: OrderedDict[int, _Shard | None] = OrderedDict()
        self._shard_bytes = 0
        # Largest plausible shard: every frame as big as raw twice over (PNG of noise is a bit over raw).
        self._limit = 2 * self.C * self._rb + 16 * self.C + 4096
        # Writer: chunk -> each row's encoded frame (None: written since, to encode; b"": never written).
        self._blobs: dict[int, list[bytes | None]] = {}
        # Rewrites: chunk -> (the decoded chunk edited_chunk returned, its frames; None: to encode).
        self._staging: dict[int, tuple[np.ndarray, list[bytes | None]]] = {}
        self._passed: tuple[int, list[bytes]] | None = None  # frames_as_encoded

    # -- reads ------------------------------------------------------------------------------------
    def _damaged(self, k: int, row: int | None, e: BaseException) -> DamagedStoreError:
        what = f"chunk {k}" if row is None else f"row {row} (chunk {k})"
        return DamagedStoreError(f"{self.loc.url}: {self.spec.array_path}: {what} does not decode "
                                 f"({type(e).__name__}: {e})")

    def _get_shards(self, ks: list[int], keep: bool = True) -> dict[int, _Shard | None]:
        """The checked shards of chunks ``ks`` (None: no file, every row empty), cached unless not
        ``keep``; fetched concurrently from a remote store."""
        out, missing = cached_split(self._shards, ks)
        if not missing:
            return out
        keys = [chunk_key(self.spec.array_path, k, self._ndim) for k in missing]
        got = self._read_encoded(keys, self._limit)
        for k, key, (buf, owner) in zip(missing, keys, got):
            shard = None
            if buf is None and self.loc.exists(key):  # there, but empty or larger than any shard
                raise self._damaged(k, None, ValueError("the shard file is empty or implausibly large"))
            if buf is not None:
                try:
                    shard = _Shard(buf, *read_index(buf, self.C), owner)
                except ValueError as e:
                    raise self._damaged(k, None, e) from None
            out[k] = shard
            if keep:
                self._shards[k] = shard
                self._shard_bytes += self._shard_cost(shard)
        while self._shards and (len(self._shards) > MAX_ENCODED or self._shard_bytes > ENCODED_BYTES):
            k, s = self._shards.popitem(last=False)
            self._shard_bytes -= self._shard_cost(s)
            out.setdefault(k, s)
        return out

    def _shard_cost(self, shard: _Shard | None) -> int:
        return 0 if shard is None or self.loc.is_local else len(shard.buf)

    def _forget_frames(self, ks: list[int] | None = None) -> None:
        super()._forget_frames(ks)
        for k in (list(self._shards) if ks is None else ks):
            self._shard_bytes -= self._shard_cost(self._shards.pop(k, None))

    def _decode_into(self, out: np.ndarray, at: list[int], ks: list[int], js: list[int],
                     shards: dict[int, _Shard | None]) -> None:
        """Decode frame ``js[n]`` of chunk ``ks[n]`` into ``out[at[n]]`` for each ``n`` (in any
        order, repeated frames allowed) on the decode threads, each frame straight into ``out``."""
        dec, C = self.codec.frame_decoder(tuple(out.shape[1:])), self.C
        # Each job with its shard looked up here (C loops: map, zip), so that a thread's GIL-held
        # steps per frame are two memoryview items, a slice, a row view and the codec's call.
        jobs = list(zip(at, map(shards.__getitem__, ks), js, ks))

        def run(todo: Iterable[tuple[int, _Shard | None, int, int]]) -> None:
            for i, s, j, k in todo:
                if s is None or (o := s.offs[j]) < 0:
                    out[i] = 0  # a row never written reads as the fill value, as zarr gives it
                    continue
                try:
                    dec(s.view[o : o + s.lens[j]], out[i])
                except TrajstoreError:
                    raise
                except Exception as e:  # a frame is input: whatever garbage makes a codec raise
                    raise self._damaged(k, k * C + j, e) from None

        parallel(run, jobs)

    def gather(self, phys: np.ndarray) -> np.ndarray:
        phys = np.asarray(phys, dtype=np.int64)
        ks = phys // self.C
        held = set(self._cache) | set(self._override)
        out = new_rows((len(phys), *self.spec.row_shape), self.spec.dtype)
        rest = np.arange(len(phys))
        if held:
            # Rows of chunks held decoded (the writer's, or staged by a rewrite) come from there.
            inside = np.isin(ks, np.fromiter(held, np.int64, len(held)))
            if inside.any():
                with temporary_rows():  # a temporary: not in the caller's memory
                    out[inside] = self._gather_whole(phys[inside], ks[inside])
                rest = np.flatnonzero(~inside)
        if len(rest):
            shards = self._get_shards(list(dict.fromkeys(ks[rest].tolist())))
            kr = ks[rest]
            self._decode_into(out, rest.tolist(), kr.tolist(), (phys[rest] - kr * self.C).tolist(), shards)
        return out

    def _decode_chunks(self, plain: list[int]) -> dict[int, np.ndarray]:
        shards = self._get_shards(plain, keep=False)
        out: dict[int, np.ndarray] = {}
        for k in plain:
            chunk = out[k] = self._empty_chunk()
            self._decode_into(chunk, list(range(self.C)), [k] * self.C, list(range(self.C)), shards)
            if self.writable:  # keep the encoded frames: a flush encodes only rows written since
                s = shards[k]
                self._blobs[k] = [b""] * self.C if s is None else [
                    b"" if (f := s.frame(i)) is None else f.tobytes() for i in range(self.C)]
        return out

    # -- rewrites of committed rows (set_at, remove_at, episode edits) ------------------------------
    def _encoded_chunk(self, k: int) -> list[bytes | None] | None:
        """The encoded frames of chunk ``k`` (``b""``: a row never written; None: a row this writer
        holds written but not yet encoded, to encode from its decoded rows), or None where this
        field holds newer rows than its shard without their frames (staged, or read from staging)."""
        if k in self._override:
            return None
        if k in self._cache:
            blobs = self._blobs.get(k)
            if blobs is not None:
                return list(blobs)
            if k in self._dirty:
                return None  # (a clean chunk holds what the shard does)
        s = self._get_shards([k], keep=False)[k]
        if s is None:
            return [b""] * self.C
        return [b"" if (f := s.frame(i)) is None else f.tobytes() for i in range(self.C)]

    def encoded_rows(self, phys: np.ndarray) -> list[bytes]:
        """The encoded frames of physical rows ``phys`` (B,) int64 as stored (``b""``: a row never
        written); rows this writer holds newer than its shards (not flushed) are encoded here."""
        out: list[bytes] = []
        for k, offs in _by_chunk(np.asarray(phys, np.int64), self.C):
            got = self._encoded_chunk(k) or [None] * self.C
            todo = [o for o in offs if got[o] is None]
            if todo:  # rows held decoded only: encoded here
                rows = self.gather(np.asarray(todo, np.int64) + k * self.C)
                for o, r in zip(todo, rows):
                    got[o] = self.codec.encode_frame(r)
            out += [got[o] or b"" for o in offs]
        return out

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        """:meth:`Field.edited_chunk`, remembering the chunk's encoded frames for
        :meth:`stage_chunk`: frames kept or moved (``src``) are staged as the bytes they are, only
        rows given ``values`` are encoded (a lossy frame decoded and encoded again loses quality)."""
        chunk = edit_chunk(self, k, offs, values, src)
        frames: list[bytes | None] | None = list(self._encoded_chunk(k) or []) or None
        if frames is not None and src is not None:
            moved: list[bytes | None] = []
            for sk, rows in _by_chunk(src, self.C):
                got = self._encoded_chunk(sk)
                if got is None:
                    frames = None
                    break
                moved += [got[r] for r in rows]
            if frames is not None:
                for o, b in zip(offs.tolist(), moved):
                    frames[o] = b
        elif frames is not None:
            for o in offs.tolist():
                frames[o] = None
        if frames is not None:
            self._staging[k] = (chunk, frames)
        return chunk

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Stage chunk ``k``: the frames :meth:`edited_chunk` kept as they are, the others encoded
        (all of them for a chunk it did not prepare)."""
        held = self._staging.pop(k, None)
        if held is None or held[0] is not data:
            return super().stage_chunk(prefix, k, data)
        frames = held[1]
        todo = [i for i, b in enumerate(frames) if b is None]
        codec = self.codec

        def run(part: Iterable[int]) -> None:
            for i in part:
                frames[i] = codec.encode_frame(data[i])

        parallel(run, todo)
        hi = min(self.C, self.allocated - k * self.C)
        out = [b or b"" for b in frames[:hi]] + [b""] * (self.C - hi)
        self.staging_meta(prefix)
        key = chunk_key(self.spec.array_path, k, self._ndim)
        try:
            self.loc.put(f"{prefix}/{key}", write_shard(out))
        except OSError as e:
            raise full_disk(e, f"{self.loc.url}/{prefix}/{key}", f"stage chunk {k} of {self.spec.array_path}")
        return key

    # -- writes -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def frames_as_encoded(self, phys_lo: int, frames: Sequence[bytes]) -> Iterator[None]:
        """Within the block: rows ``[phys_lo, phys_lo + len(frames))`` written meanwhile are stored
        as ``frames`` (bytes in this field's codec) instead of being encoded (an import passing
        frames through).  The rows written must be what ``frames`` decode to with this codec."""
        self._passed = (phys_lo, list(frames))
        try:
            yield
        finally:
            self._passed = None

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        C, n = self.C, len(data)
        ks = range(phys_lo // C, (phys_lo + n - 1) // C + 1) if n else range(0)
        for k in ks:
            if k not in self._cache:
                self._blobs.pop(k, None)  # (evicted or remapped since: its frames are read again)
        super().write(phys_lo, data)
        for k in ks:
            # A chunk held without its frames (read from a staging area) is encoded whole again.
            blobs = self._blobs.setdefault(k, [None] * C)
            lo, hi = max(phys_lo, k * C) - k * C, min(phys_lo + n, (k + 1) * C) - k * C
            blobs[lo:hi] = [None] * (hi - lo)
            if self._passed is not None:
                p0, given = self._passed
                a, b = max(k * C + lo, p0), min(k * C + hi, p0 + len(given))
                if a < b:
                    blobs[a - k * C : b - k * C] = given[a - p0 : b - p0]

    def _write_chunk(self, k: int, hi: int) -> None:
        blobs = self._blobs.setdefault(k, [None] * self.C)
        chunk = self._cache[k]
        todo = [i for i in range(hi - k * self.C) if blobs[i] is None]
        codec = self.codec

        def run(part: Iterable[int]) -> None:
            for i in part:
                blobs[i] = codec.encode_frame(chunk[i])

        parallel(run, todo)
        frames = [b if b is not None else b"" for b in blobs]
        frames[hi - k * self.C :] = [b""] * (self.C - (hi - k * self.C))
        self.loc.put(chunk_key(self.spec.array_path, k, self._ndim), write_shard(frames))

    def _evict(self) -> None:
        super()._evict()
        for k in [k for k in self._blobs if k not in self._cache]:
            del self._blobs[k]

    def close(self) -> None:
        super().close()
        self._blobs.clear()
        self._staging.clear()


def _by_chunk(phys: np.ndarray, C: int) -> list[tuple[int, list[int]]]:
    """Physical rows ``phys`` (in their order) as runs ``(chunk, offsets in it)``."""
    out: list[tuple[int, list[int]]] = []
    for r in phys.tolist():
        k, o = divmod(r, C)
        if out and out[-1][0] == k:
            out[-1][1].append(o)
        else:
            out.append((k, [o]))
    return out
