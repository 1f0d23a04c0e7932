"""Building stores from other stores, all or nothing: the destinations and sources that
:mod:`trajstore.maintenance.combine` (combine, split, filter) and :mod:`trajstore.interop` (imports,
exports) share.

A destination is a local folder built under a temporary name in its parent folder
(``.<name>.trajstore-partial-<host>-<pid>-<random>``, :func:`partial_path`, :class:`StagedFolders`), verified
(:func:`verify_written`), and only then put into place by :func:`trajstore.storage.publish.publish`
(the destination is its old store or its new one at every instant; a publish cut short by a kill is
completed by the next operation on it); on any error the temporary folders are removed, no
destination changes, and a full disk is a :class:`~trajstore.errors.StoreFullError` naming the
destinations.  Sources are read a bounded block of steps at a time
(:data:`BLOCK_BYTES`, :func:`step_blocks`), so a store larger than RAM streams through.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np

from trajstore.buffers.rows import SelectionRows
from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadArgumentError, BadOptionError, DamagedStoreError, StoreExistsError
from trajstore.maintenance.verify import verify_store
from trajstore.storage.fields.image import ImageField
from trajstore.storage.fields.video import VideoField
from trajstore.storage.publish import destination_full, partial_path, publish, recover, remove_entry

__all__ = ["BLOCK_BYTES", "local_path", "check_free", "copy_steps", "image_compressors", "partial_path", "StagedFolders", "not_a_source",
           "verify_written", "open_source", "block_rows", "step_blocks"]

#: Steps are copied in blocks of about this many bytes.
BLOCK_BYTES = 8 << 20


# -- destinations ------------------------------------------------------------------------------------
def local_path(path: Any, what: str) -> str:
    """``path`` as an absolute local folder path; ``what`` names it in errors (a URL or a ``.zip``
    is refused: these destinations are built by rename in their parent folder)."""
    if not isinstance(path, (str, os.PathLike)):
        raise BadArgumentError(f"{what} must be a path (str or os.PathLike); got {type(path).__name__}")
    p = os.fspath(path)
    if "://" in p or "::" in p or p.endswith(".zip"):
        raise BadOptionError(f"{what} {p!r}: combine, split and filter write local folders; copy the result "
                             "elsewhere with `trajstore copy` afterwards")
    return os.path.abspath(p)


def check_free(dst: str, overwrite: bool) -> None:
    """Refuse (:class:`StoreExistsError`) a destination that exists and is not an empty folder,
    unless ``overwrite``; first completes a publish to ``dst`` that a killed process left half
    done (:func:`trajstore.storage.publish.recover`), so the check sees what it left."""
    recover(dst)
    if os.path.lexists(dst) and not overwrite and (not os.path.isdir(dst) or any(os.scandir(dst))):
        raise StoreExistsError(f"{dst}: something already exists there; pass overwrite=True (--overwrite) to replace it")


class StagedFolders:
    """Temporary folders next to their destinations, published together by :meth:`commit` or
    removed by :meth:`discard` (:meth:`failed`)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, str]] = []

    def new(self, dst: str) -> str:
        """A fresh temporary folder name next to ``dst`` (not created), to be renamed to ``dst``."""
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = partial_path(dst)
        self.pairs.append((tmp, dst))
        return tmp

    def commit(self, overwrite: bool) -> None:
        """Put every temporary folder into place (:func:`trajstore.storage.publish.publish`): each
        destination is at every instant its old store or its new one, and once the first is
        touched a killed commit is completed by the next operation on any of them."""
        publish(self.pairs, overwrite=overwrite)
        self.pairs = []

    def discard(self) -> None:
        """Remove every temporary folder; no destination appears."""
        for tmp, _dst in self.pairs:
            remove_entry(tmp)
        self.pairs = []

    def failed(self, e: BaseException) -> BaseException:
        """:meth:`discard`, and ``e`` to raise: a full disk (``ENOSPC``/``EDQUOT``) as a
        :class:`~trajstore.errors.StoreFullError` naming the destinations, anything else as it is."""
        dsts = ", ".join(d for _t, d in self.pairs)
        self.discard()
        return destination_full(e, dsts) if dsts else e


def not_a_source(dst: str, sources: Sequence[Any]) -> None:
    """A destination must not be one of the stores being read (``overwrite`` would delete it)."""
    for s in sources:
        path = s.cache_path if isinstance(s, TrajectoryReplayBuffer) else s
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)) == dst:
            raise BadOptionError(f"{dst} is both a source and a destination; write to another folder")


def verify_written(path: str, storage_options: dict[str, Any] | None = None, *,
                   error: Callable[[str], Exception] | None = None, packs: bool = True) -> None:
    """Raise an error naming the first fault if the store just written at ``path`` does not verify
    (:func:`~trajstore.maintenance.verify.verify_store`).

    Parameters
    ----------
    path : str
        The store: a local folder, or a URL with ``storage_options``.
    storage_options : dict, optional
        fsspec options for a URL.
    error : callable, optional
        Builds the exception raised from the first fault's message.  Default: a
        :class:`DamagedStoreError` ``"<path>: the written store does not verify: <fault>"``; the
        CLI's ``copy`` raises its own one-line error instead (``trajstore.cli.shards.verify_copy``).
    packs : bool
        As :func:`~trajstore.maintenance.verify.verify_store` takes it (False: a linked import,
        which has just checksummed its packs' bytes, does not read them again).

    Raises
    ------
    DamagedStoreError
        The store has a fault (or what ``error`` builds).
    """
    rep = verify_store(path, storage_options=storage_options, packs=packs)
    if not rep.ok:
        fault = rep.faults[0].message
        raise (error(fault) if error is not None else
               DamagedStoreError(f"{path}: the written store does not verify: {fault}"))


# -- sources -----------------------------------------------------------------------------------------
def open_source(src: Any, what: str) -> tuple[TrajectoryReplayBuffer, bool]:
    """``(buffer, opened here)``: a TrajectoryReplayBuffer as it is, a path opened read-only."""
    if isinstance(src, TrajectoryReplayBuffer):
        return src, False
    if not isinstance(src, (str, os.PathLike)):
        raise BadArgumentError(f"{what} must be a path or a TrajectoryReplayBuffer; got {type(src).__name__}")
    return TrajectoryReplayBuffer.load_from(src, read_only=True), True


def block_rows(row_bytes: int) -> int:
    """Rows per block of about :data:`BLOCK_BYTES` for rows of ``row_bytes`` bytes (at least one)."""
    return max(1, BLOCK_BYTES // max(int(row_bytes), 1))


def video_compressors(buf: TrajectoryReplayBuffer) -> dict[str, Any] | None:
    """``compressor=`` for a copy of ``buf``'s step data: its video fields keep their settings (so
    :func:`adopt_video` can pass their segments through); every other field raw.  None: no video."""
    out: dict[str, Any] = {f.spec.array_path: f.codec for f in _video_fields(buf)}
    return (out | {"*": None}) if out else None


def _video_fields(buf: TrajectoryReplayBuffer) -> list[VideoField]:
    """The step fields of ``buf`` whose layout is "video" (the layout, recorded in the schema, says
    which engine a field has)."""
    return [cast(VideoField, f) for f in buf.rows_table.fields if f.spec.layout == "video"]


def adopt_video(src: TrajectoryReplayBuffer, ids: np.ndarray | None, out: TrajectoryReplayBuffer) -> int:
    """Before the steps of episodes ``ids`` of ``src`` (all with None) are appended to ``out`` in
    row order (:func:`step_blocks`): each video segment of ``src`` whose rows are all copied, in one
    run, is written to ``out`` byte for byte (same settings) instead of encoded again.  Returns the
    segments passed through.  (A copy reaches into both buffers' tables, as step_blocks does.)"""
    theirs = {g.spec.array_path: g for g in _video_fields(out)}
    pairs = [(f, theirs[f.spec.array_path]) for f in _video_fields(src)
             if f.spec.array_path in theirs and f.codec == theirs[f.spec.array_path].codec]
    if not pairs:
        return 0
    src.sync_reads()
    out.sync_reads()  # a writer: its staged appends handed to the tables
    t = src.rows_table
    logical = np.arange(t.count) if ids is None else SelectionRows(src.row_source(), ids).to_parent(
        np.arange(SelectionRows(src.row_source(), ids).count))
    phys = np.asarray(t.physical(np.asarray(logical, np.int64)))  # increasing: an unbounded table's rows
    if not len(phys):
        return 0
    start, n = out.rows_table.state.end, 0
    for f, g in pairs:
        for a, c in f.segments_within(int(phys[0]), int(phys[-1]) + 1):
            i = int(np.searchsorted(phys, a))
            if i + c - a <= len(phys) and phys[i] == a and phys[i + c - a - 1] == c - 1:
                g.adopt(start + i, c - a, functools.partial(f.segment_bytes, a, c))
                n += 1
    return n


def image_compressors(buf: TrajectoryReplayBuffer) -> dict[str, Any] | None:
    """``{field path: its ImageCodec}`` of the image fields of ``buf``'s steps (a ``compressor``
    for ``create`` that keeps their codecs; other fields raw), None when it has none."""
    got = {f.spec.array_path: f.codec for f in buf.row_source().table.fields if isinstance(f, ImageField)}
    return got or None


def kept_compressors(buf: TrajectoryReplayBuffer) -> dict[str, Any] | None:
    """``compressor=`` for a copy of ``buf``'s step data that keeps its image codecs
    (:func:`image_compressors`) and video settings (:func:`video_compressors`); None: neither."""
    got = (image_compressors(buf) or {}) | (video_compressors(buf) or {})
    return got or None


def copy_steps(src: TrajectoryReplayBuffer, out: TrajectoryReplayBuffer, ids: np.ndarray | None,
               episode_ids: Callable[[np.ndarray], np.ndarray]) -> Iterator[int]:
    """Append the steps of ``src``'s episodes ``ids`` (all with None) to the new unbounded store
    ``out``, with episode ids ``episode_ids(source ids)``, a block at a time (yields each block's
    steps).  Image fields stored in the same codec in both pass their frames as the bytes they are
    (:meth:`ImageField.frames_as_encoded <trajstore.storage.fields.image.ImageField.frames_as_encoded>`):
    a lossy frame is never encoded again."""
    src_fields = {f.spec.array_path: f for f in src.row_source().table.fields if isinstance(f, ImageField)}
    pairs = [(sf, f) for f in out.row_source().table.fields
             if isinstance(f, ImageField) and (sf := src_fields.get(f.spec.array_path)) is not None and sf.codec == f.codec]
    for arrays, eids, phys in step_blocks(src, ids, with_rows=True):
        with contextlib.ExitStack() as stack:
            lo = len(out)
            for sf, df in pairs:
                stack.enter_context(df.frames_as_encoded(lo, sf.encoded_rows(phys)))
            out.extend({"step_data": src.layout.step_plan.from_arrays(arrays), "episode_ids": episode_ids(eids)})
        yield len(eids)


def step_blocks(buf: TrajectoryReplayBuffer, ids: np.ndarray | None, leaves: Sequence[int] | None = None,
                with_rows: bool = False) -> Iterator[Any]:
    """``(step leaf arrays, episode ids)`` of the steps of episodes ``ids`` (all with None), in row
    order, a bounded block at a time; only the step leaves numbered ``leaves`` (default: all),
    so a remote source transfers those arrays' chunks only; ``with_rows``: ``(arrays, ids,
    physical rows (B,) int64)``."""
    buf.sync_reads()
    t = buf.rows_table
    which = list(range(len(buf.layout.step_plan.leaves))) if leaves is None else list(leaves)
    fields = which + [buf.layout.id_field]
    step = block_rows(sum(t.fields[j].spec.row_bytes for j in fields))
    if ids is None:
        for lo in range(0, t.count, step):
            *arrays, eids = t.read_contiguous(lo, min(lo + step, t.count), fields)
            yield (arrays, eids, np.asarray(t.physical(np.arange(lo, lo + len(eids))))) if with_rows else (arrays, eids)
        return
    sel = SelectionRows(buf.row_source(), ids)
    n = sel.count
    for lo in range(0, n, step):
        rows = sel.to_parent(np.arange(lo, min(lo + step, n)))
        *arrays, eids = t.gather(rows, fields)
        yield (arrays, eids, np.asarray(t.physical(rows))) if with_rows else (arrays, eids)
