"""trajstore stores as LeRobot v3.0 datasets: :func:`export_lerobot`.

The folder written is what LeRobot's ``LeRobotDataset`` reads (``datasets/utils.py``'s defaults):

- ``meta/info.json``: ``codebase_version: "v3.0"``, ``fps``, ``features`` (each step field, plus
  LeRobot's ``timestamp``, ``frame_index``, ``episode_index``, ``index``, ``task_index``),
  ``data_path`` / ``video_path`` templates, ``chunks_size`` 1000, ``data_files_size_in_mb`` 100,
  ``video_files_size_in_mb`` 200 (LeRobot 0.4.4's defaults), totals and ``splits``;
- ``meta/tasks.parquet`` (``task_index``, pandas index ``task``), ``meta/stats.json``
  (mean/std/min/max/count and q01..q99 per feature; cameras per channel as (3, 1, 1), in [0, 1]),
  ``meta/episodes/chunk-000/file-000.parquet`` (lengths, tasks, row and video offsets);
- ``data/chunk-000/file-000.parquet`` and ``videos/<key>/chunk-000/file-000.mp4`` (AV1 as
  LeRobot writes it, or H.264), every episode starting on a keyframe.

Episodes are renumbered 0..E-1 in row order (LeRobot requires it).  Field names are the leaf
paths with ``/`` as ``.`` (``obs/state`` becomes ``obs.state``).  Cameras are the (H, W, 3) uint8
fields (video fields or not); their frames are decoded and encoded again (lossy).  The
destination is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict, Discrete

from trajstore.buffers.trajectory import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError, BadValueError, UnsupportedSpaceError
from trajstore.interop._common import StepBlocks, export_source, staged_path
from trajstore.interop.lerobot_layout import DEFAULT_COLUMNS, pyarrow_module
from trajstore.interop.lerobot_video import Mp4Writer
from trajstore.maintenance.staged import step_blocks
from trajstore.spaces import ValuePlan

__all__ = ["export_lerobot"]

_WHAT = "export_lerobot"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODES_PATH = "meta/episodes/chunk-000/file-000.parquet"


def _plan(buf: TrajectoryReplayBuffer) -> tuple[dict[str, int], dict[str, int], int | None]:
    """``(tabular name -> leaf, camera name -> leaf, timestamp leaf)`` of ``buf``'s step data."""
    if not isinstance(buf.step_space, Dict):
        raise UnsupportedSpaceError(f"{_WHAT}: the step space is {buf.step_space}; expected a Dict of Boxes")
    tab, cams, ts = {}, {}, None
    for k, leaf in enumerate(ValuePlan(buf.step_space).leaves):
        name, space = leaf.name.replace("/", "."), leaf.space
        if not isinstance(space, (Box, Discrete)):
            raise UnsupportedSpaceError(f"{_WHAT}: step field {leaf.name!r} is a {type(space).__name__}; LeRobot "
                                        "features are numbers and video")
        shape = tuple(space.shape or ())
        if name == "timestamp" and shape == ():
            ts = k
        elif name in DEFAULT_COLUMNS:
            continue  # LeRobot's own columns are written from the store's structure
        elif space.dtype == np.uint8 and len(shape) == 3 and shape[2] == 3:
            cams[name] = k
        else:
            tab[name] = k
    return tab, cams, ts


def _feature(space: Any, video: bool, fps: float, codec: str) -> dict[str, Any]:
    shape = list(space.shape or ()) or [1]
    if video:
        h, w, _c = shape
        return {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                "info": {"video.height": h, "video.width": w, "video.codec": codec, "video.pix_fmt": "yuv420p",
                         "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False}}
    names = None if shape == [1] else [f"{i}" for i in range(shape[0])] if len(shape) == 1 else None
    return {"dtype": np.dtype(space.dtype).name, "shape": shape, "names": names}


def _arrow_column(a: np.ndarray) -> Any:
    import pyarrow as pa  # type: ignore[import-untyped,import-not-found,unused-ignore]

    if a.ndim == 1 or (a.ndim == 2 and a.shape[1] == 1):
        return pa.array(a.reshape(len(a)))
    col = pa.array(np.ascontiguousarray(a).reshape(-1))
    for size in reversed(a.shape[1:]):
        col = pa.FixedSizeListArray.from_arrays(col, int(size))
    return col


def _tasks_table(tasks: list[str]) -> Any:
    """``meta/tasks.parquet`` as pandas writes a frame indexed by ``task`` (LeRobot reads its index)."""
    import pyarrow as pa

    t = pa.table({"task_index": pa.array(np.arange(len(tasks), dtype=np.int64)), "task": pa.array(tasks, pa.string())})
    meta = {"index_columns": ["task"], "column_indexes": [], "pandas_version": "2.2.0", "creator": {"library": "pyarrow"},
            "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
                         "metadata": None},
                        {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
                         "metadata": None}]}
    return t.replace_schema_metadata({b"pandas": json.dumps(meta).encode()})


def _stats_json(buf: TrajectoryReplayBuffer, tab: dict[str, int], cams: dict[str, int]) -> dict[str, Any]:
    plan = ValuePlan(buf.step_space).leaves
    leaves = {name: plan[k].name for name, k in {**tab, **cams}.items()}
    if not len(buf):
        return {}
    got = buf.stats(fields=list(leaves.values()))
    out: dict[str, Any] = {}
    for name, leaf in leaves.items():
        s = got[leaf]
        entry: dict[str, Any] = {"count": [int(s["count"])]}
        for k in ("mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99"):
            v = np.asarray(s[k], np.float64)
            if name in cams:  # LeRobot: per channel (3, 1, 1), scaled to [0, 1]
                v = (v.reshape(3) / 255.0).reshape(3, 1, 1)
            entry[k] = np.atleast_1d(v).tolist()
        out[name] = entry
    return out


def export_lerobot(src: Any, path: Any, *, fps: float | None = None, video: str = "av1", robot_type: str | None = None,
                   overwrite: bool = False) -> dict[str, Any]:
    """Write a trajectory store as a LeRobot v3.0 dataset folder.

    Parameters
    ----------
    src : str, os.PathLike or TrajectoryReplayBuffer
        The store (a Dict step space of Boxes; episodes not interleaved).
    path : str or os.PathLike
        The dataset folder to write (local).
    fps : float, optional
        Frames per second (default: the store's ``fps``; one of the two is required).
    video : {"av1", "h264"}
        The cameras' codec (AV1: LeRobot's default, crf 30, g 2).
    robot_type : str, optional
        ``robot_type`` of info.json.
    overwrite : bool
        Replace what is at ``path``.

    Returns
    -------
    dict
        ``destination``, ``episodes``, ``steps``, ``cameras``.

    Raises
    ------
    BadOptionError
        No frame rate, or an unknown ``video``.
    UnsupportedSpaceError
        A step field LeRobot cannot hold, or interleaved episodes.
    BadValueError
        With cameras: a ``timestamp`` that is not ``frame_index / fps`` (within 1e-4 s), as
        LeRobot's loader finds video frames by time.
    """
    if video not in ("av1", "h264"):
        raise BadOptionError(f"{_WHAT}: video must be 'av1' or 'h264'; got {video!r}")
    buf, opened = export_source(src, f"{_WHAT}: src")
    try:
        rate = fps if fps is not None else buf.fps
        if rate is None or isinstance(rate, bool) or not 0 < float(rate) < 1e6:
            raise BadOptionError(f"{_WHAT}: the store declares no fps; pass fps=")
        with staged_path(path, f"{_WHAT}: path", overwrite) as tmp:
            result = _write(buf, tmp, float(rate), video, robot_type)
        result["destination"] = os.path.abspath(os.fspath(path))
        result["source"] = buf.cache_path if opened or not isinstance(src, (str, os.PathLike)) else os.fspath(src)
        return result
    finally:
        if opened:
            buf.close()


def _write(buf: TrajectoryReplayBuffer, tmp: str, fps: float, video: str, robot_type: str | None) -> dict[str, Any]:
    pq = pyarrow_module(_WHAT)
    import pyarrow as pa

    tab, cams, ts_leaf = _plan(buf)
    StepBlocks(buf, _WHAT)  # refuses interleaved episodes
    info = buf.robot_info()
    tasks = list(info.tasks) or [""]
    has_none = any(e not in info.episode_tasks for e in buf.episodes()["episode_id"].tolist())
    if has_none and "" not in tasks:
        tasks.append("")
    os.makedirs(os.path.join(tmp, "meta", "episodes", "chunk-000"))
    os.makedirs(os.path.join(tmp, "data", "chunk-000"))
    leaves = ValuePlan(buf.step_space).leaves  # the step arrays' order
    writers = {}
    for name, k in cams.items():
        os.makedirs(os.path.join(tmp, "videos", name, "chunk-000"))
        shape = tuple(leaves[k].space.shape or ())
        writers[name] = Mp4Writer(os.path.join(tmp, VIDEO_PATH.format(video_key=name, chunk_index=0, file_index=0)),
                                  int(round(fps)) if float(fps).is_integer() else fps, shape[:2], video)  # type: ignore[arg-type]
    data_writer: Any = None
    episodes: list[dict[str, Any]] = []
    index, frame, last, done = 0, 0, None, False
    try:
        for arrays, eids in step_blocks(buf, None):
            cuts = np.flatnonzero(eids[1:] != eids[:-1]) + 1
            bounds = [0, *cuts.tolist(), len(eids)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                eid = int(eids[a])
                if eid != last:
                    if episodes:
                        episodes[-1]["to"] = index
                    t = info.episode_tasks.get(eid)
                    episodes.append({"task": tasks[t] if t is not None else "", "from": index})
                    last, frame = eid, 0
                m = b - a
                fi = np.arange(frame, frame + m, dtype=np.int64)
                ts = _timestamps(arrays[ts_leaf][a:b] if ts_leaf is not None else None, fi, fps, bool(cams), eid)
                cols = {name: _arrow_column(np.asarray(arrays[k][a:b])) for name, k in tab.items()}
                cols |= {"timestamp": pa.array(ts), "frame_index": pa.array(fi),
                         "episode_index": pa.array(np.full(m, len(episodes) - 1, np.int64)),
                         "index": pa.array(np.arange(index, index + m, dtype=np.int64)),
                         "task_index": pa.array(np.full(m, tasks.index(episodes[-1]["task"]), np.int64))}
                table = pa.table(cols)
                if data_writer is None:
                    data_writer = pq.ParquetWriter(os.path.join(tmp, DATA_PATH.format(chunk_index=0, file_index=0)),
                                                   table.schema)
                data_writer.write_table(table)
                for name, k in cams.items():
                    writers[name].add(np.asarray(arrays[k][a:b]), new_episode=frame == 0)
                index += m
                frame += m
        if episodes:
            episodes[-1]["to"] = index
        done = True
    finally:
        if data_writer is not None:
            data_writer.close()
        failed: list[BaseException] = []
        for w in writers.values():  # each closed (its encoder stopped) even when another raises
            try:
                w.close(finish=done and not failed)  # after an error: no more encoding (the files are removed)
            except BaseException as e:  # noqa: BLE001  # re-raised below, once every writer is closed
                failed.append(e)
        if failed and done:
            raise failed[0]
    _meta(tmp, buf, episodes, tasks, tab, cams, fps, video, robot_type, pq)
    return {"episodes": len(episodes), "steps": index, "cameras": sorted(cams)}


def _timestamps(ts: np.ndarray | None, fi: np.ndarray, fps: float, video: bool, eid: int) -> np.ndarray:
    """LeRobot's ``timestamp`` column (float32 s) of frames ``fi``: the store's, or ``fi / fps``.

    With cameras, LeRobot finds a frame's picture at ``from_timestamp + timestamp`` in the MP4,
    whose frames are ``1 / fps`` apart: a store timestamp off ``frame_index / fps`` by more than
    LeRobot's tolerance (1e-4 s) would show another frame, so it is refused (BadValueError)."""
    grid = fi / fps
    if ts is None:
        return grid.astype(np.float32)
    if video:
        off = np.abs(np.asarray(ts, np.float64) - grid)
        if (off > 1e-4).any():
            i = int(np.argmax(off > 1e-4))
            raise BadValueError(f"{_WHAT}: episode {eid}, frame {int(fi[i])}: timestamp {float(ts[i])!r} is not "
                                f"frame_index / fps = {float(grid[i])!r}; LeRobot finds video frames at that time "
                                "(pass the fps the store was recorded at)")
    return np.asarray(ts).astype(np.float32)


def _meta(tmp: str, buf: TrajectoryReplayBuffer, episodes: list[dict[str, Any]], tasks: list[str],
          tab: dict[str, int], cams: dict[str, int], fps: float, video: str, robot_type: str | None, pq: Any) -> None:
    import pyarrow as pa

    leaves = ValuePlan(buf.step_space).leaves  # the step arrays' order
    cols: dict[str, Any] = {
        "episode_index": pa.array(np.arange(len(episodes), dtype=np.int64)),
        "tasks": pa.array([[e["task"]] for e in episodes], pa.list_(pa.string())),
        "length": pa.array([e["to"] - e["from"] for e in episodes], pa.int64()),
        "data/chunk_index": pa.array(np.zeros(len(episodes), np.int64)),
        "data/file_index": pa.array(np.zeros(len(episodes), np.int64)),
        "dataset_from_index": pa.array([e["from"] for e in episodes], pa.int64()),
        "dataset_to_index": pa.array([e["to"] for e in episodes], pa.int64())}
    for name in cams:
        cols[f"videos/{name}/chunk_index"] = pa.array(np.zeros(len(episodes), np.int64))
        cols[f"videos/{name}/file_index"] = pa.array(np.zeros(len(episodes), np.int64))
        cols[f"videos/{name}/from_timestamp"] = pa.array([e["from"] / fps for e in episodes], pa.float64())
        cols[f"videos/{name}/to_timestamp"] = pa.array([e["to"] / fps for e in episodes], pa.float64())
    cols["meta/episodes/chunk_index"] = pa.array(np.zeros(len(episodes), np.int64))
    cols["meta/episodes/file_index"] = pa.array(np.zeros(len(episodes), np.int64))
    pq.write_table(pa.table(cols), os.path.join(tmp, EPISODES_PATH))
    pq.write_table(_tasks_table(tasks), os.path.join(tmp, "meta", "tasks.parquet"))
    features: dict[str, Any] = {}
    for name, k in {**tab, **cams}.items():
        features[name] = _feature(leaves[k].space, name in cams, fps, video)
    for name, dt in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                     ("index", "int64"), ("task_index", "int64")):
        features[name] = {"dtype": dt, "shape": [1], "names": None}
    total = episodes[-1]["to"] if episodes else 0
    info = {"codebase_version": "v3.0", "robot_type": robot_type, "total_episodes": len(episodes),
            "total_frames": total, "total_tasks": len(tasks), "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200, "fps": int(fps) if float(fps).is_integer() else fps,
            "splits": {"train": f"0:{len(episodes)}"}, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if cams else None, "features": features}
    with open(os.path.join(tmp, "meta", "info.json"), "w") as f:
        json.dump(info, f, indent=4)
    with open(os.path.join(tmp, "meta", "stats.json"), "w") as f:
        json.dump(_stats_json(buf, tab, cams), f, indent=4)
