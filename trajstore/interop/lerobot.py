"""LeRobot datasets into trajstore: :func:`import_lerobot` (v3.0 and v2.1 folders).

A LeRobot dataset (:mod:`.lerobot_layout`) becomes a :class:`~trajstore.TrajectoryReplayBuffer`
whose step space is ``Dict`` of one Box per feature (LeRobot's names, e.g.
``"observation.state"``, ``"action"``, ``"observation.images.top"`` as (H, W, 3) uint8), plus
``timestamp`` (float64 seconds, shape ()) and ``task_index`` (int64, shape ()); episode ids are
LeRobot's ``episode_index``; the store declares LeRobot's ``fps`` and holds its task dictionary
(task index k is LeRobot's ``task_index`` k) with each episode's (first) task
(docs/robot.md).  ``frame_index`` and ``index`` are the step's position and are not stored.

Cameras stay video: each episode's packets are taken from the MP4 shard as they are
(:meth:`~.lerobot_video.Mp4Index.segment`: where they are comes from the MP4's sample table,
:mod:`.mp4_table`) and stored as the episode's video segment
(:meth:`~trajstore.storage.fields.video.VideoField.adopt`), without decoding or encoding, when the
codec is AV1 or H.264 and the episode starts on a keyframe; any other episode is decoded and
encoded again (counted in the result's ``transcoded``).  AV1 packets are copied file to file when
the segment is written (:mod:`trajstore.storage.spans`), so each MP4 stays open until the commit
after its last episode.  The store is verified before it is renamed into place as ``trajstore
verify`` checks one (segments' frame tables; :func:`~trajstore.storage.fields.video_check.check_video`).  ``video="png"`` (or any other
``compressor`` value) stores decoded frames with that codec instead.

``link=True`` copies no packets: each AV1 MP4 is hard-linked into the store as a pack (from the
file the foreign gate opened, the inodes compared: :func:`~trajstore.storage.fields.video_pack.link_pack`)
and each episode's segment is a *linked segment* naming its packets' bytes there with their
crc32c, computed from bounded reads of the open file (the one read of the packets); where no link
can be made the packets are copied as without it (``link_fallbacks`` in the result).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.core.progress import progress_bar
from trajstore.errors import BadArgumentError, BadOptionError, ForeignFileError, TimeOrderError
from trajstore.interop._common import box_for, check_destination
from trajstore.interop.lerobot_layout import (
    Episode,
    LeRobotLayout,
    column_array,
    episode_starts,
    read_layout,
    read_parquet,
)
from trajstore.interop.lerobot_video import ADOPTABLE, Mp4Index, av_module, episode_frames, index_packets
from trajstore.maintenance.staged import StagedFolders, local_path, verify_written
from trajstore.storage.fields.video import VideoField
from trajstore.storage.fields.video_codec import VideoCodec
from trajstore.storage.fields.video_pack import crc_of_range, link_pack, linked_segment, pack_key
from trajstore.storage.publish import destination_full
from trajstore.storage.robot_files import RobotInfo
from trajstore.storage.spans import FileSpan, PutData

__all__ = ["import_lerobot", "lerobot_space", "probe_codec", "data_groups", "file_columns"]

_WHAT = "import_lerobot"
#: The import commits once this many bytes of segments or raw frames are held, or episodes appended.
FLUSH_BYTES = 64 << 20
FLUSH_EPISODES = 256
#: Threads reading the linked packets' crc32c beside the appends (pread and crc32c release the GIL;
#: two read the page cache about twice as fast as one where two CPUs are free).
CRC_THREADS = 2
#: Bytes a linked segment holds per frame (its frame table), counted toward FLUSH_BYTES.
LINKED_FRAME_BYTES = 24
#: MP4s read to their end are kept open (their packets are copied at the next commit) up to this many.
MAX_RETIRED = 64


def lerobot_space(lay: LeRobotLayout) -> Dict:
    """The step space of a store holding ``lay``: ``timestamp``, ``task_index`` and each feature."""
    spaces: dict[str, Any] = {"timestamp": Box(0.0, np.inf, (), np.float64),
                              "task_index": Box(0, max(len(lay.tasks) - 1, 0), (), np.int64)}
    for k, f in lay.features.items():
        spaces[k] = Box(0, 255, f.shape, np.uint8) if f.video else box_for(f.dtype, f.shape, f"{lay.root}: {k}")
    return Dict(spaces)


def probe_codec(lay: LeRobotLayout, key: str) -> str | None:
    """The trajstore codec (``"av1"``, ``"h264"``) of camera ``key``'s first MP4, or None when it
    is one trajstore does not keep as it is."""
    if not lay.episodes:
        return None
    av = av_module(_WHAT)
    path = lay.video_key(key, lay.episodes[0])
    with lay.open(path) as f:
        try:
            c = av.open(f, "r", format="mp4")
        except Exception as e:  # noqa: BLE001  # the file is input
            raise ForeignFileError(f"{lay.where(path)}: not a readable MP4 ({type(e).__name__}: {e})") from None
        try:
            name = c.streams.video[0].codec_context.name if c.streams.video else None
        finally:
            c.close()
    return ADOPTABLE.get(name or "")


def _compressors(lay: LeRobotLayout, video: Any) -> tuple[dict[str, Any], dict[str, str | None]]:
    """``(compressor=, adopt codec per camera)``: kept video uses the MP4's codec (AV1 with
    LeRobot's settings for new encodes, H.264 likewise), else ``video`` for every camera."""
    comp: dict[str, Any] = {"*": None}
    adopt: dict[str, str | None] = {}
    for key in lay.videos:
        if video == "keep":
            codec = probe_codec(lay, key)
            adopt[key] = codec
            comp[key] = VideoCodec(codec or "av1", gop=2)
        else:
            adopt[key] = None
            comp[key] = video
    return comp, adopt


def _same(blob: PutData) -> PutData:
    """``blob`` itself (an adopted segment's bytes or pieces, held until the flush writes them)."""
    return blob


def _linked_bytes(pack: int, a: int, b: int, crc: Future[int], pos: np.ndarray, size: np.ndarray,
                  keys: np.ndarray) -> bytes:
    """A linked segment's bytes once the crc32c of its packets is known (the flush asks)."""
    return linked_segment(pack, a, b, crc.result(), pos, size, keys)


class _Importer:
    """The store being written and the per-episode steps (one instance per import)."""

    def __init__(self, lay: LeRobotLayout, buf: TrajectoryReplayBuffer, adopt: dict[str, str | None],
                 link: bool = False) -> None:
        self.lay, self.buf, self.adopt, self.link = lay, buf, adopt, link
        self.fields = {f.spec.array_path: f for f in buf.rows_table.fields if f.spec.layout == "video"}
        self.transcoded = {k: 0 for k in lay.videos}
        self.mp4: dict[str, tuple[str, Mp4Index]] = {}
        self.retired: list[Mp4Index] = []  # MP4s done with, open until the next flush copies their packets
        self.held, self.pending = 0, 0  # bytes held for the next flush (segments, raw frames), episodes
        self.adopted = {k: 0 for k in lay.videos}
        self.blank: dict[tuple[int, int], np.ndarray] = {}  # one black (H, W, 3) frame per camera size
        # Linked imports: (camera, MP4 key) -> its pack number (-1: not linked, copied), and per camera
        # the episodes whose segment is linked; MP4s that could not be linked (and the last reason).
        self.packs: dict[tuple[str, str], int] = {}
        self.linked = {k: 0 for k in lay.videos}
        self.link_fallbacks, self.link_why = 0, ""
        # The packets' crc32c are read on CRC_THREADS threads beside the appends (pread and crc32c
        # release the GIL): the import then takes about the longer of the two, not their sum.
        self.crcs: ThreadPoolExecutor | None = None

    def _video_field(self, key: str) -> VideoField | None:
        for path, f in self.fields.items():
            if path.split("/")[-1] == key:
                return f  # type: ignore[return-value]  # layout "video" fields are VideoFields
        return None

    def _index(self, key: str, path: str, shape: tuple[int, int]) -> Mp4Index:
        """The packet index of camera ``key``'s MP4 ``path`` (one kept open per camera: episodes
        come in file order, so each file is demuxed once, not once per episode)."""
        held = self.mp4.get(key)
        if held is not None and held[0] == path:
            return held[1]
        if held is not None:
            self.retired.append(held[1])  # adopted segments name spans of it: closed once flushed
            del self.mp4[key]
            if len(self.retired) >= MAX_RETIRED:
                self.flush()
        f = self.lay.open(path)
        try:
            idx = index_packets(f, self.lay.where(path), shape)
        except BaseException:
            f.close()
            raise
        self.mp4[key] = (path, idx)
        return idx

    def flush(self) -> None:
        """Commit what was appended (the adopted segments' packets copied from their MP4s), then
        close the MP4s no longer read."""
        self.buf.flush()  # one commit per batch: a commit (and the segment index) per episode costs more
        self.held, self.pending = 0, 0
        for idx in self.retired:
            idx.close()
        self.retired.clear()

    def close(self) -> None:
        """Close the MP4s held open (after :meth:`flush`: a segment not yet written that names a
        span of a closed MP4 fails to write, ValueError, instead of reading another file), once no
        crc32c is being read from them (a descriptor closed under a read could be reused by
        another file)."""
        if self.crcs is not None:
            self.crcs.shutdown(wait=True, cancel_futures=True)
        for idx in self.retired + [idx for _path, idx in self.mp4.values()]:
            idx.close()
        self.mp4.clear()
        self.retired.clear()

    def _pack(self, key: str, path: str, idx: Mp4Index, field: VideoField) -> int:
        """The pack number of camera ``key``'s MP4 ``path`` in the store, hard-linked into it from the
        file the index holds open on its first episode; -1 when no link can be made (counted)."""
        k = self.packs.get((key, path))
        if k is not None:
            return k
        k = sum(1 for (c, _p), n in self.packs.items() if c == key and n >= 0)
        local = None if self.lay.source.fs is not None else os.path.join(self.lay.root, path)
        why = link_pack(field.loc, pack_key(field.spec.array_path, k), idx.fileobj, local)
        if why:
            k, self.link_why = -1, why
            self.link_fallbacks += 1
        self.packs[(key, path)] = k
        return k

    def _linked(self, key: str, path: str, idx: Mp4Index, field: VideoField,
                ep: Episode) -> Callable[[], bytes] | None:
        """Episode ``ep``'s linked segment for camera ``key`` (its packets named in the MP4's pack,
        their crc32c computed from bounded reads of the file: the one read of them, on the crc
        thread), as the call that returns its bytes at the flush, or None where it cannot be
        linked (H.264, a remote file, no link made: the packets are copied)."""
        _c, _f, t0, t1 = ep.videos[key]
        got = idx.in_place(t0, t1, self.lay.fps, ep.length)
        if got is None:
            return None
        k = self._pack(key, path, idx, field)
        if k < 0:
            return None
        pos, size, keys = got
        a, b = int(pos.min()), int((pos + size).max())
        if self.crcs is None:
            self.crcs = ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="trajstore-import-crc")
        crc = self.crcs.submit(crc_of_range, idx.fileobj.fileno(), a, b, idx.where)
        self.linked[key] += 1
        return functools.partial(_linked_bytes, k, a, b, crc, pos, size, keys)

    def _camera(self, key: str, ep: Episode, start: int) -> np.ndarray:
        """Frames of camera ``key`` for ``ep``: placeholders when its packets are adopted as the
        segment of rows ``[start, start + length)``, else decoded."""
        lay, feat = self.lay, self.lay.features[key]
        path = lay.video_key(key, ep)
        _c, _f, t0, t1 = ep.videos[key]
        h, w = feat.shape[:2]
        field = self._video_field(key)
        want = self.adopt.get(key)
        if want is not None and field is not None:
            idx = self._index(key, path, (h, w))
            lo, hi = idx.range(t0, t1, lay.fps)
            if idx.codec == want and hi - lo == ep.length and not idx.adoptable(lo, hi):
                linked = self._linked(key, path, idx, field, ep) if self.link else None
                if linked is not None:
                    field.adopt(start, ep.length, linked)
                    self.held += LINKED_FRAME_BYTES * ep.length
                else:
                    blob = idx.segment(t0, t1, lay.fps, ep.length)
                    field.adopt(start, ep.length, functools.partial(_same, blob))
                    self.held += len(blob) if isinstance(blob, (bytes, bytearray)) else sum(
                        len(p) for p in blob if not isinstance(p, FileSpan))  # a span's packets are not held
                self.adopted[key] += 1
                # placeholders, one frame of memory: the segment is the MP4's packets, nothing is encoded
                blank = self.blank.get((h, w))
                if blank is None:
                    blank = self.blank[(h, w)] = np.zeros((h, w, 3), np.uint8)
                return np.broadcast_to(blank, (ep.length, h, w, 3))
            if hi - lo == ep.length:
                self.transcoded[key] += 1
        self.held += ep.length * h * w * 3  # held raw until the writer encodes them at the next flush
        with lay.open(path) as f:  # also raises, naming the file, when the MP4 lacks the episode's frames
            return episode_frames(f, lay.where(path), t0, t1, lay.fps, ep.length, (h, w))

    def episode(self, cols: dict[str, np.ndarray], key: str, ep: Episode, lo: int) -> None:
        """Append episode ``ep`` from the data file ``key``, whose columns are ``cols``
        (:func:`file_columns`; the episode's rows from ``lo``)."""
        lay, where = self.lay, self.lay.where(key)
        ts = cols["timestamp"][lo : lo + ep.length]
        bad = np.flatnonzero(~(np.diff(ts) >= 0))
        if bad.size or not np.isfinite(ts).all():
            i = int(bad[0]) + 1 if bad.size else 0
            raise TimeOrderError(f"{where}: episode {ep.index}: timestamp of row {lo + i} ({ts[i]!r}) goes back in "
                                 "time or is not finite; timestamps must not decrease within an episode")
        step: dict[str, Any] = {"timestamp": ts}
        if "task_index" in cols:
            step["task_index"] = cols["task_index"][lo : lo + ep.length]
        else:
            first = lay.tasks.index(ep.tasks[0]) if ep.tasks else 0
            step["task_index"] = np.full(ep.length, first, np.int64)
        if len(step["task_index"]) and not (0 <= step["task_index"].min() and step["task_index"].max() <
                                            max(len(lay.tasks), 1)):
            raise ForeignFileError(f"{where}: episode {ep.index}: task_index outside meta/tasks' 0..{len(lay.tasks) - 1}")
        for k in lay.tabular:
            step[k] = cols[k][lo : lo + ep.length]
        self.buf.sync_reads()
        start = self.buf.rows_table.state.end
        for k in lay.videos:
            step[k] = self._camera(k, ep, start)
        self.buf.extend({"step_data": step, "episode_ids": np.full(ep.length, ep.index, np.int64)})
        self.buf.mark_episode_end()
        self.pending += 1
        if self.held >= FLUSH_BYTES or self.pending >= FLUSH_EPISODES:
            self.flush()


def data_groups(lay: LeRobotLayout) -> list[tuple[str, list[Episode]]]:
    """Episodes grouped by data file, files in order of their first episode."""
    groups: dict[str, list[Episode]] = {}
    for ep in lay.episodes:
        groups.setdefault(lay.data_key(ep), []).append(ep)
    return list(groups.items())


def file_columns(lay: LeRobotLayout, key: str) -> dict[str, np.ndarray]:
    """The columns of data file ``key`` an import stores, each converted once for the whole file
    (a slice per episode costs more): ``episode_index``, ``timestamp`` (float64) and
    ``task_index`` (int64, when the file has one), (rows,) each, and each tabular feature as (rows,
    *shape) of its declared dtype.

    Raises
    ------
    ForeignFileError
        As :func:`~.lerobot_layout.column_array` (naming the file and column).
    """
    where = lay.where(key)
    names = ["episode_index", "timestamp", *lay.tabular]
    has_task = "task_index" in lay.info["features"]
    table = read_parquet(lay.source, key, names + (["task_index"] if has_task else []))
    i8, f8 = np.dtype(np.int64), np.dtype(np.float64)
    cols = {"episode_index": column_array(table, "episode_index", i8, (), where),
            "timestamp": column_array(table, "timestamp", f8, (), where)}
    if "task_index" in table.column_names:
        cols["task_index"] = column_array(table, "task_index", i8, (), where)
    for k in lay.tabular:
        f = lay.features[k]
        cols[k] = column_array(table, k, f.dtype, f.shape, where)
    return cols


def _episodes(lay: LeRobotLayout, imp: _Importer, bar: Any) -> int:
    """Append every episode, data file by data file; returns the steps written."""
    steps = 0
    for key, eps in data_groups(lay):
        cols = file_columns(lay, key)
        for ep, lo in zip(eps, episode_starts(cols.pop("episode_index"), eps, lay.where(key))):
            imp.episode(cols, key, ep, lo)
            steps += ep.length
            bar.update(1)
    return steps


def import_lerobot(src: Any, cache_path: Any, *, video: Any = "keep", save_stats: bool = False,
                   storage_options: dict[str, Any] | None = None, tqdm: bool | None = None, overwrite: bool = False,
                   link: bool = False, **create_kwargs: Any) -> dict[str, Any]:
    """Import a LeRobot dataset folder (v3.0, or v2.1: one file per episode) as a new trajectory store.

    Parameters
    ----------
    src : str or os.PathLike
        The dataset folder (``meta/info.json``, ``data/``, ``videos/``): a local path or an fsspec
        URL (``s3://bucket/dataset``, ``memory://...``).
    cache_path : str or os.PathLike
        The store to write (a new local folder; built under a temporary name and renamed into
        place once verified: nothing appears there on failure).
    video : "keep" or compressor value
        ``"keep"``: cameras stay video, their packets taken from the MP4s unchanged where the codec
        is AV1 or H.264 and the episode starts on a keyframe (else decoded and encoded again with
        the same codec); any other value (``"png"``, ``"jpeg:90"``, ``"h264"``...) is the
        ``compressor`` of the decoded frames.
    save_stats : bool
        Store every episode's statistics (:meth:`~trajstore.TrajectoryReplayBuffer.save_stats`;
        decodes video).
    storage_options : dict, optional
        fsspec options of a URL ``src``.
    tqdm : bool, optional
        Progress bar (None: when stderr is a terminal).
    overwrite : bool
        Replace what is at ``cache_path``.
    link : bool
        Hard-link each AV1 MP4 into the store (``<camera>/video/pack/<k>``) and keep each episode
        as a *linked segment* naming its packets there, instead of copying them: the import reads
        the packets once (their crc32c) and writes no video bytes.  Where no link can be made
        (another filesystem, a refusal, no ``/proc``, a URL source) the packets are copied
        (counted in ``link_fallbacks``).  The store then shares those files with the dataset:
        editing a source MP4 in place changes the store, which ``trajstore verify`` and reads of
        the rows report (DamagedStoreError); deleting or renaming it does not.  Copies of the
        store hold their own packets.
    **create_kwargs
        Passed to :meth:`~trajstore.TrajectoryReplayBuffer.create` (``chunk_rows``, ...).

    Returns
    -------
    dict
        ``destination``, ``steps``, ``episodes``, ``version``, ``adopted`` and ``transcoded``
        (episodes per camera whose packets were kept / encoded again), ``linked`` (episodes per
        camera kept as linked segments), ``link_fallbacks`` (MP4s copied because no link could be
        made; ``link_fallback_why``: the last reason), ``verified``.

    Raises
    ------
    NotATrajstoreError
        No ``meta/info.json`` (or ``src`` is not a folder).
    ForeignFileError
        Malformed metadata, a hostile path template, data files that contradict ``meta/episodes``,
        an MP4 shorter than its episodes claim (naming the file).
    TimeOrderError
        Timestamps going back within an episode (naming the file and row).
    MissingDependencyError
        pyarrow (the ``interop`` extra) or PyAV (the ``video`` extra) is missing.
    """
    if not isinstance(src, (str, os.PathLike)):
        raise BadArgumentError(f"{_WHAT}: src must be a path or URL (str or os.PathLike); got {type(src).__name__}")
    check_destination(cache_path, overwrite, create_kwargs, _WHAT)
    if "compressor" in create_kwargs:
        raise BadOptionError(f"{_WHAT}: choose the cameras' codec with video=, not compressor=")
    lay = read_layout(src, storage_options)
    root = lay.root
    out_path = local_path(cache_path, f"{_WHAT}: cache_path")
    comp, adopt = _compressors(lay, video)
    staged = StagedFolders()
    buf: TrajectoryReplayBuffer | None = None
    bar: Any = None
    try:
        tmp = staged.new(out_path)
        buf = TrajectoryReplayBuffer.create(lerobot_space(lay), cache_path=tmp, compressor=comp, **create_kwargs)
        imp = _Importer(lay, buf, adopt, link)
        bar = progress_bar(len(lay.episodes), f"{_WHAT} into {os.path.basename(out_path)}", tqdm, unit="episode")
        try:
            steps = _episodes(lay, imp, bar)
            imp.flush()  # while the MP4s whose packets the last segments copy are open
        finally:
            imp.close()
        first = {ep.index: lay.tasks.index(ep.tasks[0]) for ep in lay.episodes if ep.tasks}
        buf.put_robot_info(RobotInfo(lay.fps, list(lay.tasks), first))
        if save_stats and lay.episodes:
            buf.save_stats()
        buf.close()
        buf = None
        verify_written(tmp, packs=not link)  # a linked import has just checksummed its packs' bytes
        staged.commit(overwrite)
    except BaseException as e:
        if buf is not None:
            try:
                buf.close()
            except Exception:  # noqa: BLE001  # already failing: removing the folder matters more
                pass
        raise staged.failed(destination_full(e, out_path)) from None
    finally:
        if bar is not None:
            bar.close()
    return {"source": root, "destination": out_path, "steps": steps, "episodes": len(lay.episodes), "version": lay.version,
            "adopted": imp.adopted, "transcoded": imp.transcoded, "linked": imp.linked,
            "link_fallbacks": imp.link_fallbacks, "link_fallback_why": imp.link_why, "verified": True}
