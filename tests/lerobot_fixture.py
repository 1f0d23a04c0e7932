"""LeRobot datasets written per LeRobot's specification with pyarrow and PyAV (any size, codec and
file split, without LeRobot; tests/data/lerobot_v3 is one LeRobot's own writer made): v3.0 (episodes concatenated in shared Parquet and MP4 files, each episode
encoded from a keyframe as LeRobot's concatenation leaves it) and v2.1 (one file per episode)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

H, W = 48, 64
TASKS = ["pick cube", "place cube"]


def frame_of(ep: int, t: int, size: tuple[int, int] = (H, W)) -> np.ndarray:
    """Frame ``t`` of episode ``ep``: smooth and distinct (video compresses it well)."""
    y, x = np.mgrid[0 : size[0], 0 : size[1]]
    base = ((x * 3 + y * 2 + t * 5 + ep * 40) % 256).astype(np.uint8)
    return np.stack([base, base + np.uint8(85), 255 - base], -1)


def frames_of(ep: int, n: int, size: tuple[int, int] = (H, W)) -> np.ndarray:
    """Frames 0..n-1 of episode ``ep`` (n, H, W, 3) uint8."""
    return np.stack([frame_of(ep, t, size) for t in range(n)])


#: Seconds one encoding attempt may take before it counts as hung (the largest fixture takes a few).
ENCODE_LIMIT_S = 180.0


def _encode(path: str, episodes: Callable[[], Iterable[Iterable[np.ndarray]]], fps: int, codec: str,
            force_key: bool = True) -> None:
    """Encode the frames of ``episodes()`` (an iterable per episode) into one MP4 at ``path``.

    Each attempt runs in a forked child given :data:`ENCODE_LIMIT_S`; a hung or failed attempt is
    killed and made again from scratch, three attempts in all.  Why: libsvtav1 (the AV1 encoder in
    PyAV's FFmpeg) once deadlocked in the suite (2026-12-06, under load: every one of its threads
    waiting on a futex inside ``svt_av1_enc_send_picture``, no CPU used, until the test's time limit;
    upstream reports hangs of SVT-AV1 3.1.x), and CI once saw one of its packets refused by the MP4
    muxer (EINVAL) in a 1,000-episode file that 60 runs here encoded cleanly (the packets around a
    refusal are printed, so a second sighting says which timestamps were wrong).
    """
    for attempt in range(1, 4):
        pid = os.fork()
        if pid == 0:  # the child: encode, then leave without running the parent's exit handlers
            code = 1
            try:
                _encode_once(path, episodes(), fps, codec, force_key)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        deadline, pause, status = time.monotonic() + ENCODE_LIMIT_S, 0.001, None
        while True:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        if status == 0:
            return
        why = f"hung for {ENCODE_LIMIT_S:.0f} s" if status is None else f"failed (exit {status})"
        print(f"lerobot_fixture: encoding {path} {why} (attempt {attempt} of 3)", file=sys.stderr)
    raise RuntimeError(f"lerobot_fixture: encoding {path} failed three times (see stderr)")


def _encode_once(path: str, episodes: Iterable[Iterable[np.ndarray]], fps: int, codec: str, force_key: bool) -> None:
    import av

    os.environ.setdefault("SVT_LOG", "1")
    c = av.open(path, "w", format="mp4")
    s = c.add_stream("libsvtav1" if codec == "av1" else "libx264", rate=fps)
    first = None
    s.options = {"g": "2", "crf": "30" if codec == "av1" else "18", "preset": "12" if codec == "av1" else "veryfast"}
    if codec == "h264":
        s.codec_context.max_b_frames = 0
    pts, seen = 0, []
    for fr in episodes:
        it = iter(fr)
        f0 = next(it)
        if first is None:
            first = f0
            s.width, s.height, s.pix_fmt = f0.shape[1], f0.shape[0], "yuv420p"
        for i, f in enumerate(itertools.chain([f0], it)):
            vf = av.VideoFrame.from_ndarray(f, format="rgb24")
            vf.pts = pts
            if i == 0 and force_key:
                vf.pict_type = av.video.frame.PictureType.I
            pts += 1
            for p in s.encode(vf):
                _mux(c, p, seen)
    for p in s.encode(None):
        _mux(c, p, seen)
    c.close()


def _mux(c: Any, p: Any, seen: list[tuple[Any, Any]]) -> None:
    seen.append((p.pts, p.dts))
    try:
        c.mux(p)
    except Exception:
        print(f"lerobot_fixture: packet {len(seen) - 1} refused; (pts, dts) of the last ones: {seen[-4:]}",
              file=sys.stderr)
        raise


def _features(cams: list[str], size: tuple[int, int] = (H, W), dims: tuple[int, int] = (3, 2),
              fps: int = 10) -> dict[str, Any]:
    f: dict[str, Any] = {
        "observation.state": {"dtype": "float32", "shape": [dims[0]], "names": [f"s{i}" for i in range(dims[0])]},
        "action": {"dtype": "float32", "shape": [dims[1]], "names": [f"a{i}" for i in range(dims[1])]},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
    }
    for cam in cams:
        f[cam] = {"dtype": "video", "shape": [size[0], size[1], 3], "names": ["height", "width", "channels"],
                  "info": {"video.fps": fps, "video.codec": "av1", "video.pix_fmt": "yuv420p"}}
    for k, dt in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                  ("index", "int64"), ("task_index", "int64")):
        f[k] = {"dtype": dt, "shape": [1], "names": None}
    return f


def step_values(ep: int, n: int, dims: tuple[int, int] = (3, 2)) -> dict[str, np.ndarray]:
    t = np.arange(n, dtype=np.float32)
    state = np.stack([t, t * 2 + ep, -t], 1)
    action = np.stack([t / 10, np.full(n, ep, np.float32)], 1)
    return {"observation.state": np.resize(state.T, (dims[0], n)).T.astype(np.float32),
            "action": np.resize(action.T, (dims[1], n)).T.astype(np.float32),
            "next.reward": (t / n).astype(np.float32)}


def _data_table(lengths: list[int], first_index: int = 0, ep0: int = 0, dims: tuple[int, int] = (3, 2),
                fps: int = 10) -> Any:
    import pyarrow as pa

    cols: dict[str, list[Any]] = {k: [] for k in ("observation.state", "action", "next.reward", "timestamp",
                                                  "frame_index", "episode_index", "index", "task_index")}
    index = first_index
    for e, n in enumerate(lengths, start=ep0):
        v = step_values(e, n, dims)
        cols["observation.state"] += v["observation.state"].tolist()
        cols["action"] += v["action"].tolist()
        cols["next.reward"] += v["next.reward"].tolist()
        cols["timestamp"] += (np.arange(n) / float(fps)).astype(np.float32).tolist()
        cols["frame_index"] += list(range(n))
        cols["episode_index"] += [e] * n
        cols["index"] += list(range(index, index + n))
        cols["task_index"] += [e % 2] * n
        index += n
    return pa.table({"observation.state": pa.array(cols["observation.state"], pa.list_(pa.float32(), dims[0])),
                     "action": pa.array(cols["action"], pa.list_(pa.float32(), dims[1])),
                     "next.reward": pa.array(cols["next.reward"], pa.float32()),
                     "timestamp": pa.array(cols["timestamp"], pa.float32()),
                     "frame_index": pa.array(cols["frame_index"], pa.int64()),
                     "episode_index": pa.array(cols["episode_index"], pa.int64()),
                     "index": pa.array(cols["index"], pa.int64()),
                     "task_index": pa.array(cols["task_index"], pa.int64())})


def write_v3(root: str, lengths: list[int], cams: tuple[str, ...] = ("observation.images.top",),
             codec: str = "av1", fps: int = 10, force_key: bool = True, size: tuple[int, int] = (H, W),
             dims: tuple[int, int] = (3, 2), files: int = 1) -> str:
    """A LeRobot v3.0 dataset: the episodes split in order over ``files`` data files
    (data/chunk-000/file-00k.parquet) and as many MP4s per camera (times restart in each)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for d in ("meta/episodes/chunk-000", "data/chunk-000", *[f"videos/{c}/chunk-000" for c in cams]):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    info = {"codebase_version": "v3.0", "robot_type": "fixture", "total_episodes": len(lengths),
            "total_frames": sum(lengths), "total_tasks": 2, "chunks_size": 1000, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 500, "fps": fps, "splits": {"train": f"0:{len(lengths)}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
            "features": _features(list(cams), size, dims, fps)}
    with open(os.path.join(root, "meta/info.json"), "w") as f:
        json.dump(info, f, indent=4)
    groups = np.array_split(np.arange(len(lengths)), files)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    file_of = np.zeros(len(lengths), np.int64)
    t_from = np.zeros(len(lengths))
    for k, g in enumerate(groups):
        eps = g.tolist()
        file_of[eps] = k
        t_from[eps] = (starts[eps] - starts[eps[0]]) / fps
        pq.write_table(_data_table([lengths[e] for e in eps], int(starts[eps[0]]), eps[0], dims, fps),
                       os.path.join(root, f"data/chunk-000/file-{k:03d}.parquet"))
        for cam in cams:
            _encode(os.path.join(root, f"videos/{cam}/chunk-000/file-{k:03d}.mp4"),
                    lambda eps=eps: ((frame_of(e, t, size) for t in range(lengths[e])) for e in eps), fps, codec, force_key)
    ep: dict[str, Any] = {"episode_index": list(range(len(lengths))),
                          "tasks": [[TASKS[e % 2]] for e in range(len(lengths))], "length": lengths,
                          "data/chunk_index": [0] * len(lengths), "data/file_index": file_of.tolist(),
                          "dataset_from_index": starts[:-1].tolist(), "dataset_to_index": starts[1:].tolist()}
    for cam in cams:
        ep[f"videos/{cam}/chunk_index"] = [0] * len(lengths)
        ep[f"videos/{cam}/file_index"] = file_of.tolist()
        ep[f"videos/{cam}/from_timestamp"] = t_from.tolist()
        ep[f"videos/{cam}/to_timestamp"] = (t_from + np.asarray(lengths) / fps).tolist()
    pq.write_table(pa.table(ep), os.path.join(root, "meta/episodes/chunk-000/file-000.parquet"))
    tasks = pa.table({"task_index": pa.array([0, 1], pa.int64()), "task": pa.array(TASKS)})
    pq.write_table(tasks, os.path.join(root, "meta/tasks.parquet"))
    with open(os.path.join(root, "meta/stats.json"), "w") as f:
        json.dump({"action": {"mean": [0.0, 0.0]}}, f)
    return root


def write_v21(root: str, lengths: list[int], cam: str = "observation.images.top", fps: int = 10) -> str:
    """A LeRobot v2.1 dataset: one Parquet and one MP4 per episode, JSON-lines metadata."""
    import pyarrow.parquet as pq

    os.makedirs(os.path.join(root, "meta"), exist_ok=True)
    info = {"codebase_version": "v2.1", "fps": fps, "chunks_size": 1000, "total_episodes": len(lengths),
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": _features([cam], fps=fps)}
    with open(os.path.join(root, "meta/info.json"), "w") as f:
        json.dump(info, f)
    with open(os.path.join(root, "meta/tasks.jsonl"), "w") as f:
        for i, t in enumerate(TASKS):
            f.write(json.dumps({"task_index": i, "task": t}) + "\n")
    start = 0
    with open(os.path.join(root, "meta/episodes.jsonl"), "w") as f:
        for e, n in enumerate(lengths):
            f.write(json.dumps({"episode_index": e, "tasks": [TASKS[e % 2]], "length": n}) + "\n")
            os.makedirs(os.path.join(root, "data/chunk-000"), exist_ok=True)
            os.makedirs(os.path.join(root, f"videos/chunk-000/{cam}"), exist_ok=True)
            pq.write_table(_data_table([n], start, e, fps=fps), os.path.join(root, f"data/chunk-000/episode_{e:06d}.parquet"))
            _encode(os.path.join(root, f"videos/chunk-000/{cam}/episode_{e:06d}.mp4"), lambda e=e, n=n: [frames_of(e, n)], fps, "av1")
            start += n
    return root


# -- the dataset LeRobot's own writer made (tests/data/lerobot_v3, scripts/make_lerobot_fixture.py) --
#: Its folder, its camera, frame size (H, W), fps, episodes x frames, and each episode's task.
WRITTEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lerobot_v3")
WRITTEN_CAM = "observation.images.top"
WRITTEN_SIZE = (32, 48)
WRITTEN_FPS = 10
WRITTEN_EPISODES, WRITTEN_LENGTH = 3, 20
WRITTEN_TASKS = ["pick cube", "place cube"]


def written_task(ep: int) -> str:
    """Episode ``ep``'s task (episodes 0 and 2 pick, 1 places)."""
    return WRITTEN_TASKS[ep % 2]


def written_step(ep: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(state, action) of step ``t`` of episode ``ep``: (6,) float32 each, exact in float32."""
    j = np.arange(6, dtype=np.float32)
    state = (j * 0.25 + t * 0.5 + ep * 100).astype(np.float32)
    action = (-j * 0.125 + t * 0.75 - ep).astype(np.float32)
    return state, action


def written_frame(ep: int, t: int) -> np.ndarray:
    """Camera frame of step ``t`` of episode ``ep``: (32, 48, 3) uint8."""
    return frame_of(ep, t, WRITTEN_SIZE)
