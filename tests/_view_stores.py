"""Stores and a running server shared by the tests of ``trajstore view`` (tests/test_view*.py)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gymnasium.spaces import Box, Dict, Discrete

from trajstore import TrajectoryReplayBuffer

H, W = 24, 32  # image frames: small, and not square (a swapped axis shows)


def frames_of(episode: int, length: int) -> np.ndarray:
    """The camera frames recorded for ``episode``: (length, H, W, 3) uint8, distinct per step."""
    rng = np.random.default_rng(episode)
    f = rng.integers(0, 256, (length, H, W, 3), dtype=np.uint8)
    f[:, 0, :, 0] = np.arange(length, dtype=np.uint8)[:, None]  # the step, readable in row 0
    return f


#: The task of episode e of :func:`image_store` is ``TASKS[e % 3]``.
TASKS = ("pick cube", "place cube", "stack cubes")
#: The frame rate :func:`image_store` declares.
FPS = 10.0


def image_store(path: Path, episodes: int = 3, length: int = 12, capacity: int | None = None,
                robot: bool = False) -> str:
    """A trajectory store of ``episodes`` episodes: a PNG-coded camera, a grey raw frame, a 2-d
    action, a reward and the episode data ``goal`` (int) and ``success`` (float).  ``robot``: it
    also declares :data:`FPS`, gives episode e the task ``TASKS[e % 3]`` and stores statistics."""
    space = Dict({"cam": Box(0, 255, (H, W, 3), np.uint8), "grey": Box(0, 255, (16, 16), np.uint8),
                  "action": Box(-1, 1, (2,), np.float32), "reward": Box(-10, 10, (), np.float32)})
    eps = Dict({"goal": Discrete(8), "success": Box(0, 1, (), np.float32)})
    buf = TrajectoryReplayBuffer.create(space, cache_path=str(path), episode_data_instance_space=eps,
                                        compressor={"cam": "png"}, step_data_capacity=capacity)
    for e in range(episodes):
        append_episode(buf, e, length)
    if robot:
        buf.set_fps(FPS)
        for e in range(episodes):
            buf.assign_task(e, TASKS[e % 3])
    buf.close(save_stats=robot)
    return str(path)


def append_episode(buf: TrajectoryReplayBuffer, e: int, length: int) -> None:
    """Episode ``e`` (returns grow with ``e``), its data set, ended and committed."""
    steps = np.arange(length, dtype=np.float32)
    buf.extend({"cam": frames_of(e, length), "grey": np.full((length, 16, 16), e * 10 % 256, np.uint8),
                "action": np.stack([np.sin(steps / 3), np.cos(steps / 3)], 1).astype(np.float32),
                "reward": np.full(length, 0.1 * (e + 1), np.float32)})
    buf.set_current_episode_data({"goal": e % 3, "success": np.float32(e % 2)})
    buf.mark_episode_end()
    buf.flush()


def video_store(path: Path, episodes: int = 2, length: int = 8) -> tuple[str, np.ndarray]:
    """A trajectory store whose camera ``cam`` is an H.264 video field of 64x48 frames (one stream
    per episode) and an action; returns its path and every frame recorded, (episodes * length, 48,
    64, 3) uint8 (the stored frames decode to these within the codec's loss)."""
    y, x = np.mgrid[0:48, 0:64].astype(np.float64)
    allf = np.stack([np.stack([128 + 60 * np.sin((x + 3 * i + 7 * c) / 6) + 50 * np.cos((y - i) / 5)
                               for c in range(3)], -1) for i in range(episodes * length)]).clip(0, 255).astype(np.uint8)
    space = Dict({"cam": Box(0, 255, (48, 64, 3), np.uint8), "action": Box(-1, 1, (2,), np.float32)})
    with TrajectoryReplayBuffer.create(space, cache_path=str(path), compressor={"cam": "h264:crf=18:g=4"}) as buf:
        for e in range(episodes):
            buf.extend({"cam": allf[e * length:(e + 1) * length], "action": np.zeros((length, 2), np.float32)})
            buf.mark_episode_end()
    return str(path), allf


def tree_hashes(root: str | os.PathLike[str]) -> dict[str, str]:
    """sha256 of every file under ``root`` (and the names of its folders): a store before and after."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            out[os.path.relpath(os.path.join(folder, d), root) + "/"] = "dir"
        for f in files:
            p = os.path.join(folder, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


@contextmanager
def serving(path: str | os.PathLike[str], **kw: Any) -> Iterator[Any]:
    """``trajstore view``'s server for ``path`` on 127.0.0.1 and a free port, in a thread."""
    from trajstore.cli.view import open_view

    server = open_view(path, **kw)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        t.join(10)


def get(server: Any, target: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, str]:
    """(status, body, content type) of GET ``target`` on ``server``."""
    req = urllib.request.Request(server.url.rstrip("/") + target, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers.get("Content-Type", "")


def get_json(server: Any, target: str) -> tuple[int, Any]:
    status, body, _ = get(server, target)
    return status, json.loads(body)
