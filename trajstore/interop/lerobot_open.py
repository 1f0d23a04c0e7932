"""LeRobot datasets opened in place: :func:`open_lerobot`.

The dataset's files are read where they are, as a read-only
:class:`~trajstore.TrajectoryReplayBuffer` (:class:`LeRobotBuffer`), with nothing written:

- tabular features (and ``timestamp``, ``task_index``) are read from the data Parquet files once,
  at open, into memory (:class:`ArrayField`; LeRobot's data files are small next to its videos);
- each camera is a :class:`~trajstore.storage.fields.video.VideoField` whose segments (one per
  episode) are served by :class:`Mp4Segments`: a read-only location that indexes an MP4 shard's
  packets (time, offset, size, keyframe) the first time an episode of it is read, and gives an
  episode's segment as the packets of its time range read at their offsets (H.264 turned into
  Annex B) — the same decoder, GOP grouping and threads as a store's own video;
- the store's fps, task dictionary and episode tasks are LeRobot's (``buf.fps``, ``buf.tasks``),
  so ``get_time_windows`` / ``TimeWindowDataset`` read LeRobot's ``delta_timestamps`` windows.

Limits: episode ids are positions 0..E-1 in ``episode_index`` order; an episode whose packets
cannot be kept as they are (not starting on a keyframe, B-frames, a codec other than AV1 or
H.264) raises :class:`~trajstore.errors.DamagedStoreError` naming the file when its frames are
read: import it (:func:`~trajstore.interop.import_lerobot` re-encodes such episodes).
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any, NoReturn

import numpy as np

from trajstore.buffers.in_place import InPlaceStore, InPlaceTrajectoryBuffer
from trajstore.errors import BadArgumentError, ReadOnlyError, TimeOrderError
from trajstore.interop.lerobot import data_groups, lerobot_space, probe_codec
from trajstore.interop.lerobot_layout import LeRobotLayout, column_array, episode_starts, read_layout, read_parquet
from trajstore.interop.lerobot_video import Mp4Index, index_packets
from trajstore.spaces import ValuePlan
from trajstore.storage.fields.base import Field, gather_windows_by_rows
from trajstore.storage.fields.foreign import EpisodeIdField
from trajstore.storage.fields.spec import FieldSpec
from trajstore.storage.fields.video import VideoField, write_index, write_segment
from trajstore.storage.fields.video_codec import VIDEO_ATTR, VideoCodec
from trajstore.storage.keys import ROBOT_KEY
from trajstore.storage.location import Location
from trajstore.storage.robot_files import RobotInfo, robot_bytes

__all__ = ["open_lerobot", "LeRobotBuffer", "ArrayField", "Mp4Segments"]

_WHAT = "open_lerobot"


def _refuse(what: str) -> NoReturn:
    raise ReadOnlyError(f"a LeRobot dataset opened in place is read-only ({what}); import it to write")


class ArrayField:
    """A field over an in-memory array (rows along axis 0; a
    :class:`~trajstore.storage.fields.base.Field`, read-only)."""

    keeps_partial_chunk = False
    writable = False
    open_from: int | None = None

    def __init__(self, loc: Location, path: str, data: np.ndarray, chunk_rows: int = 4096) -> None:
        self.loc, self.data = loc, data
        self.spec = FieldSpec(path, data.shape[1:], data.dtype, chunk_rows, "foreign")
        self.C = chunk_rows
        self.allocated = len(data)

    def gather(self, phys: np.ndarray) -> np.ndarray:
        """Rows ``phys`` (B,), a new array."""
        return self.data[np.asarray(phys, np.int64)]

    def gather_windows(self, phys: np.ndarray, length: int) -> np.ndarray:
        """``length`` consecutive rows from each of ``phys``."""
        return gather_windows_by_rows(self, phys, length)

    def read_range(self, lo: int, hi: int, copy: bool = True) -> np.ndarray:
        """Rows ``[lo, hi)``."""
        return self.data[lo:hi].copy() if copy else self.data[lo:hi]

    def read_chunk(self, k: int) -> np.ndarray:
        """Rows of chunk ``k``, zero-padded to ``C`` rows."""
        out = np.zeros((self.C, *self.spec.row_shape), self.spec.dtype)
        part = self.data[k * self.C : (k + 1) * self.C]
        out[: len(part)] = part
        return out

    def end_run(self, row: int) -> None:
        """Nothing is written."""

    def ensure_mapped(self, phys_lo: int, phys_hi: int, create: bool) -> None:
        """Nothing to map."""

    def grow(self, allocated: int) -> None:
        """Refused."""
        _refuse("add rows")

    def write(self, phys_lo: int, data: np.ndarray) -> None:
        """Refused."""
        _refuse("write rows")

    def edited_chunk(self, k: int, offs: np.ndarray, values: np.ndarray | None = None,
                     src: np.ndarray | None = None) -> np.ndarray:
        """Refused."""
        _refuse("rewrite rows")

    def stage_chunk(self, prefix: str, k: int, data: np.ndarray) -> str:
        """Refused."""
        _refuse("rewrite rows")

    def remap(self, ks: list[int], prefix: str = "") -> None:
        """Nothing is cached."""

    def reload(self) -> None:
        """Nothing is cached."""

    def drop_cache(self) -> None:
        """Nothing is cached."""

    def flush(self, fsync: bool, hold: int | None = None) -> None:
        """Nothing is written."""

    def close(self) -> None:
        """Nothing to release."""


class Mp4Segments(Location):
    """A read-only location whose keys are those a trajstore store would hold for the dataset's
    video fields and robot metadata, computed from the LeRobot files: ``<cam>/video/index`` (the
    episodes' row bounds), ``<cam>/video/<lo>`` (the episode starting at row ``lo``, as a
    segment) and ``trajstore.robot.json``."""

    def __init__(self, lay: LeRobotLayout, starts: np.ndarray) -> None:
        super().__init__(SimpleNamespace(read_only=True), lay.root, None)
        self.lay, self.starts = lay, starts
        self.paths = {f"{_WHAT}/{k}": k for k in lay.videos}
        self.indexes: dict[str, Mp4Index] = {}
        self.lock = threading.Lock()
        tasks = {i: lay.tasks.index(ep.tasks[0]) for i, ep in enumerate(lay.episodes) if ep.tasks}
        self.robot = robot_bytes(RobotInfo(lay.fps, list(lay.tasks), tasks))

    def _index(self, path: str, cam: str) -> Mp4Index:
        """The packet index of camera ``cam``'s MP4 ``path`` (built at its first read, kept open)."""
        with self.lock:
            got = self.indexes.get(path)
            if got is None:
                f = self.lay.open(path)
                try:  # frames of another size than info.json declares are refused here, naming the MP4
                    h, w = self.lay.features[cam].shape[:2]
                    got = index_packets(f, self.lay.where(path), (h, w))
                except BaseException:
                    f.close()
                    raise
                if len(self.indexes) >= 256:  # files kept open at most
                    self.indexes.pop(next(iter(self.indexes))).close()
                self.indexes[path] = got
            return got

    def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        """The bytes a store would hold at ``key`` (None: nothing there)."""
        if key == ROBOT_KEY:
            return self.robot
        array_path, _, rest = key.rpartition("/video/")
        cam = self.paths.get(array_path)
        if cam is None:
            return None
        if rest == "index":
            return write_index(self.starts.tolist())
        lo = int(rest) if rest.isdigit() else -1
        i = int(np.searchsorted(self.starts, lo))
        if i >= len(self.starts) - 1 or int(self.starts[i]) != lo:
            return None
        ep = self.lay.episodes[i]
        path = self.lay.video_key(cam, ep)
        _c, _f, t0, t1 = ep.videos[cam]
        packets, keys = self._index(path, cam).episode(t0, t1, self.lay.fps, ep.length)
        return write_segment(packets, keys)

    def exists(self, key: str) -> bool:
        """Whether :meth:`get` gives bytes for ``key``."""
        return key == ROBOT_KEY or key.rpartition("/video/")[0] in self.paths

    def list_prefix(self, prefix: str) -> list[str]:
        """Nothing is listed (the video keys are computed)."""
        return []

    def close(self) -> None:
        """Close the MP4s and forget their packet indexes."""
        with self.lock:
            for idx in self.indexes.values():
                idx.close()
            self.indexes.clear()


class LeRobotBuffer(InPlaceTrajectoryBuffer):
    """A LeRobot dataset (v3.0 or v2.1) opened in place: a read-only
    :class:`~trajstore.TrajectoryReplayBuffer` with the step space of
    :func:`~trajstore.interop.import_lerobot`'s stores, LeRobot's fps and tasks.  Open it with
    :func:`open_lerobot`; ``load_from`` (the same) reopens it by path in DataLoader workers."""

    source_format = "LeRobot"

    @classmethod
    def load_from(cls, path: str | os.PathLike[str], *, backend: str = "numpy", device: Any = None,
                  read_only: bool = True, multiprocessing: bool = False,
                  storage_options: dict[str, Any] | None = None, **kwargs: Any) -> "LeRobotBuffer":
        """:func:`open_lerobot` (``read_only`` must stay True)."""
        cls.check_open_args(_WHAT, read_only, multiprocessing)
        return open_lerobot(path, backend=backend, device=device, storage_options=storage_options)


def open_lerobot(path: Any, *, backend: str = "numpy", device: Any = None,
                 storage_options: dict[str, Any] | None = None) -> LeRobotBuffer:
    """Open a LeRobot dataset folder read-only in place, without copying it.

    Parameters
    ----------
    path : str or os.PathLike
        The dataset folder (v3.0 or v2.1): a local path or an fsspec URL.
    backend : {"numpy", "torch"}
        What reads return.
    device : optional
        Torch device (backend ``"torch"``).
    storage_options : dict, optional
        fsspec options of a URL ``path``.

    Returns
    -------
    LeRobotBuffer
        Step space ``Dict(timestamp: () float64, task_index: () int64, <feature>: Box...)``,
        cameras (H, W, 3) uint8 decoded on read; ``fps``, ``tasks`` and ``episode_tasks()`` from
        the dataset.  Writes raise :class:`~trajstore.errors.ReadOnlyError`.

    Raises
    ------
    NotATrajstoreError, ForeignFileError, TimeOrderError, MissingDependencyError
        As :func:`~trajstore.interop.import_lerobot` for the metadata and data files (the MP4s
        are checked when first read).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise BadArgumentError(f"{_WHAT}: path must be a path or URL (str or os.PathLike); got {type(path).__name__}")
    lay = read_layout(path, storage_options)
    lengths = np.array([ep.length for ep in lay.episodes], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    loc = Mp4Segments(lay, starts)
    space = lerobot_space(lay)
    columns = _columns(lay, int(starts[-1]))
    fields: list[Field] = []
    for leaf in ValuePlan(space).leaves:
        name = str(leaf.path[0])
        if name in lay.videos:
            fields.append(_video_field(loc, lay, name, int(starts[-1])))
        else:
            fields.append(ArrayField(loc, f"{_WHAT}/{name}", columns[name]))
    fields.append(EpisodeIdField(loc, "meta/episodes", starts[1:], 4096))
    store = InPlaceStore(loc, fields, int(starts[-1]), len(lay.episodes), closer=loc.close)
    try:
        return LeRobotBuffer(store, space, backend, device)
    except BaseException:
        store.close()
        raise


def _video_field(loc: Mp4Segments, lay: LeRobotLayout, name: str, rows: int) -> VideoField:
    codec = probe_codec(lay, name) or "av1"
    spec = FieldSpec(f"{_WHAT}/{name}", lay.features[name].shape, np.dtype(np.uint8), 4096, "video")
    meta = SimpleNamespace(shape=(rows,), attrs={VIDEO_ATTR: VideoCodec(codec, gop=2).to_dict()})
    return VideoField(loc, spec, meta, False)  # type: ignore[arg-type]  # shape and attrs are all it reads


def _columns(lay: LeRobotLayout, rows: int) -> dict[str, np.ndarray]:
    """Every tabular column (and timestamp, task_index) of every episode, in episode order: per
    data file one ``take`` of its episodes' rows, one conversion per column."""
    out = {"timestamp": np.empty(rows, np.float64), "task_index": np.zeros(rows, np.int64)}
    for k in lay.tabular:
        f = lay.features[k]
        out[k] = np.empty((rows, *f.shape), f.dtype)
    pos = 0
    has_task = "task_index" in lay.info["features"]
    for key, eps in data_groups(lay):
        where = lay.where(key)
        t = read_parquet(lay.source, key, ["episode_index", "timestamp", *lay.tabular] + (["task_index"] if has_task else []))
        ids = column_array(t, "episode_index", np.dtype(np.int64), (), where)
        lengths = np.array([ep.length for ep in eps], np.int64)
        firsts = np.asarray(episode_starts(ids, eps, where), np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        take = np.repeat(firsts - offsets, lengths) + np.arange(int(lengths.sum()))
        part = t.take(take)
        sl = slice(pos, pos + len(take))
        ts = column_array(part, "timestamp", np.dtype(np.float64), (), where)
        back = np.diff(ts) < 0
        back[(offsets[1:] - 1)] = False  # an episode's first step may be earlier than the last one's
        if back.any() or not np.isfinite(ts).all():
            e = int(np.searchsorted(offsets, int(np.flatnonzero(back)[0]) + 1 if back.any() else 0, side="right")) - 1
            raise TimeOrderError(f"{where}: episode {eps[e].index}: timestamps go back in time or are not finite")
        out["timestamp"][sl] = ts
        if has_task:
            out["task_index"][sl] = column_array(part, "task_index", np.dtype(np.int64), (), where)
        for k in lay.tabular:
            f = lay.features[k]
            out[k][sl] = column_array(part, k, f.dtype, f.shape, where)
        pos += len(take)
    return out
