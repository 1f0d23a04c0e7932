"""Child-process code and row encodings for the TrajectoryReplayBuffer tests
(``test_trajectory_processes.py``).

Children are started with the helpers of ``_workers.py`` (same start-method rules: the
``TRAJSTORE_TEST_START`` environment variable, default ``forkserver``).  Every function that
runs in a child lives at module level and takes only picklable arguments.

Row contents are deterministic functions of integers, so the parent can check any row it
sees without knowing what the child did:

* SIGKILL loop: step ``k`` of episode ``eid`` -> :func:`encode_steps`; the data of episode
  ``eid`` at version ``ver`` -> :func:`encode_episode`;
* multiprocessing writers: step ``i`` of writer ``w`` that is step ``k`` of the writer's
  episode ``j`` -> :func:`encode_tagged`.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _workers as W  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402

# ----------------------------------------------------------------------------------------
# spaces and encodings
# ----------------------------------------------------------------------------------------
STEP_SPACE = Dict({
    "obs": Box(-np.inf, np.inf, (4,), np.float32),
    "img": Box(0, 255, (4, 4), np.uint8),
    "tag": Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (), np.int64),
})
EP_SPACE = Box(-np.inf, np.inf, (3,), np.float64)  # [eid, version, 1.0 (present flag)]
_PAT = np.arange(16, dtype=np.int64).reshape(4, 4)


def encode_steps(a: Any, b: Any) -> dict[str, np.ndarray]:
    """Steps identified by two integers (episode id and step number, or writer and step)."""
    a = np.asarray(a, dtype=np.int64).reshape(-1)
    b = np.broadcast_to(np.asarray(b, dtype=np.int64), a.shape)
    obs = np.empty((len(a), 4), np.float32)
    obs[:, 0] = a
    obs[:, 1] = b
    obs[:, 2] = (a * 7 + b * 3) % 1009
    obs[:, 3] = -(a % 101) - 0.5
    img = ((a * 31 + b * 17)[:, None, None] + _PAT) % 251
    return {"obs": obs, "img": img.astype(np.uint8), "tag": a * 1_000_003 + b}


def decode_steps(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(a, b, ok)`` of every row; ok: every leaf agrees with :func:`encode_steps` (an all-zero
    row decodes to (0, 0) and is only ok if it really is step (0, 0))."""
    obs = np.asarray(batch["obs"], dtype=np.float32)
    n = len(obs)
    if n == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0, bool)
    a, b, ok = decode_field("obs", obs)
    exp = encode_steps(a, b)
    ok &= (np.asarray(batch["img"]) == exp["img"]).reshape(n, -1).all(axis=1)
    ok &= np.asarray(batch["tag"]) == exp["tag"]
    return a, b, ok


def decode_field(key: str, values: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(a, b, ok)`` of frames of one step leaf that names its step by itself (``"obs"`` or
    ``"tag"``), for per-field windows that read only some leaves; any leading shape (``(B, T)``),
    the same shape out.  ``ok``: the frame is a whole row's value (every ``tag`` is some step's)."""
    v = np.asarray(values)
    if key == "obs":
        lead = v.shape[:-1]
        obs = v.reshape(-1, 4).astype(np.float32)
        a, b = obs[:, 0].astype(np.int64), obs[:, 1].astype(np.int64)
        ok = (obs == encode_steps(a, b)["obs"]).all(axis=1)
    elif key == "tag":
        lead = v.shape
        a, b = np.divmod(v.reshape(-1).astype(np.int64), 1_000_003)
        ok = np.ones(len(a), bool)
    else:
        raise ValueError(f"leaf {key!r} does not name its step by itself; decode 'obs' or 'tag'")
    return a.reshape(lead), b.reshape(lead), ok.reshape(lead)


def one(batch: dict[str, np.ndarray], i: int = 0) -> dict[str, Any]:
    return {k: v[i] for k, v in batch.items()}


def encode_episode(eid: int, version: int) -> np.ndarray:
    return np.array([eid, version, 1.0], np.float64)


# ----------------------------------------------------------------------------------------
# child: episode writer killed at random (SIGKILL loop)
# ----------------------------------------------------------------------------------------
def episode_loop(store: str, side: str, ready: str, seed: int, deadline_s: float = 60.0) -> None:
    """Open ``store`` as the writer and record episodes of random length 1..12 forever:
    steps ``encode_steps(eid, k)`` (``eid = current_episode_id``) by append and small extends,
    episode data set once or twice (version 1, 2: the second is an in-place overwrite)
    after the episode's first step, ``mark_episode_end``, and flushes now and then.  After
    each flush returns, ``side`` records (fsync'd) what that flush made durable:
    ``{"rows", "last": [eid, k], "data": [eid, version]}``.  Runs until SIGKILLed."""
    rng = np.random.default_rng(seed)
    rb = TrajectoryReplayBuffer.load_from(store, commit_interval=0.05)
    W.touch(ready)
    last = [-1, -1]
    data = [-1, -1]
    t_end = time.monotonic() + deadline_s

    def flush() -> None:
        rb.flush()
        W.write_atomic(side, json.dumps({"rows": len(rb), "last": last, "data": data}))

    while time.monotonic() < t_end:
        eid = rb.current_episode_id
        length = int(rng.integers(1, 13))
        data_after = int(rng.integers(1, length + 1))
        n_sets = int(rng.choice([0, 1, 2], p=[0.2, 0.5, 0.3]))
        version = 0
        k = 0
        while k < length:
            if rng.random() < 0.5:
                rb.append(one(encode_steps([eid], [k])))
                k += 1
            else:
                b = int(min(length - k, rng.integers(1, 5)))
                rb.extend(encode_steps(np.full(b, eid), np.arange(k, k + b)))
                k += b
            last = [eid, k - 1]
            if k >= data_after and version < n_sets:
                version += 1  # version 2 overwrites version 1 in place
                rb.set_current_episode_data(encode_episode(eid, version))
                data = [eid, version]
            if rng.random() < 0.04:
                flush()
        rb.mark_episode_end()
        if rng.random() < 0.25:
            flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------
# child: multiprocessing=True writer
# ----------------------------------------------------------------------------------------
def mp_episode_writer(rb: TrajectoryReplayBuffer, w: int, n: int, seed: int, result: str) -> None:
    """Write steps ``encode_steps(w, i)`` for i in 0..n-1 in episodes of random length 1..30
    (append and small extends), setting the episode data of about half the episodes to
    ``[w * 1000 + j, 0, 1]`` (j: the writer's episode number), then ``mark_episode_end``.
    Reports ``{"ok", "episodes": [[first_i, length, has_data], ...]}``."""
    try:
        rng = np.random.default_rng(seed)
        episodes = []
        i = 0
        j = 0
        while i < n:
            length = int(min(n - i, rng.integers(1, 31)))
            first = i
            has_data = bool(rng.random() < 0.5)
            data_set = False
            while i < first + length:
                if rng.random() < 0.6:
                    rb.append(one(encode_steps([w], [i])))
                    i += 1
                else:
                    b = int(min(first + length - i, rng.integers(2, 8)))
                    rb.extend(encode_steps(np.full(b, w), np.arange(i, i + b)))
                    i += b
                if has_data and not data_set:  # after the episode's first step(s)
                    rb.set_current_episode_data(np.array([w * 1000 + j, 0, 1], np.float64))
                    data_set = True
            rb.mark_episode_end()
            episodes.append([first, length, has_data])
            j += 1
        W._result(result, ok=True, episodes=episodes)
    except BaseException:
        W._result(result, ok=False, error=traceback.format_exc())
        raise


def try_second_writer(store: str, result: str) -> None:
    """From another process: try a second writer (plain, multiprocessing) and a reader."""
    out: dict[str, Any] = {}
    for what in ("load_from", "load_from_mp", "read_only"):
        try:
            if what == "load_from":
                TrajectoryReplayBuffer.load_from(store).close()
            elif what == "load_from_mp":
                TrajectoryReplayBuffer.load_from(store, multiprocessing=True).close()
            else:
                with TrajectoryReplayBuffer.load_from(store, read_only=True) as r:
                    out["reader_rows"] = len(r)
            out[what] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[what] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    W._result(result, **out)


def mp_steady_writer(store: str, n: int, ready: str, result: str) -> None:
    """Open ``store`` with multiprocessing=True and append steps ``encode_steps(7, i)`` one at a
    time, ending an episode every 10 steps; report ``{"ok"}`` or the error."""
    try:
        rb = TrajectoryReplayBuffer.load_from(store, multiprocessing=True)
        W.touch(ready)
        for i in range(n):
            rb.append(one(encode_steps([7], [i])))
            if i % 10 == 9:
                rb.mark_episode_end()
        rb.close()
        W._result(result, ok=True)
    except BaseException:
        W._result(result, ok=False, error=traceback.format_exc())
        raise


# ----------------------------------------------------------------------------------------
# child: remove_at killed at random (crash-atomic rewrite of steps and episode data)
# ----------------------------------------------------------------------------------------
def remove_loop(store: str, ready: str, seed: int, deadline_s: float = 60.0) -> None:
    """Open ``store`` as the writer and alternate: delete a few random steps (sometimes every
    step of an episode, which must also drop its episode data) with ``remove_at``, then record
    a new episode with data so the store never runs dry.  Runs until SIGKILLed."""
    rng = np.random.default_rng(seed)
    rb = TrajectoryReplayBuffer.load_from(store)
    W.touch(ready)
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        n = len(rb)
        if n > 20:
            eps = rb.episodes()
            if rng.random() < 0.5 and len(eps["episode_id"]) > 1:
                j = int(rng.integers(0, len(eps["episode_id"]) - 1))
                rows = np.arange(eps["start"][j], eps["start"][j] + eps["length"][j])
            else:
                rows = rng.choice(n, size=int(rng.integers(1, 6)), replace=False)
            rb.remove_at(rows)
        eid = rb.current_episode_id
        length = int(rng.integers(2, 9))
        rb.extend(encode_steps(np.full(length, eid), np.arange(length)))
        rb.set_current_episode_data(encode_episode(eid, 1))
        rb.mark_episode_end()
    os._exit(0)
