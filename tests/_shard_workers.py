"""Child programs of ``test_shards.py``: shard writers, each writing its own shard of one dataset.

Step ``k`` of episode ``e`` of writer ``w`` holds ``obs = [w, e, k, L]`` (``L``: the episode's
length, a function of ``w`` and ``e``), so a reader checks any row it sees without knowing the
writer's timing.  After each ``flush()`` the writer appends ``F <episodes> <steps>`` to its log
(one ``os.write`` per line: a SIGKILL never tears a line that :func:`_kill_workers.parse_log` reads).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore.shards import create_shard

SPACE = Dict({"obs": Box(-np.inf, np.inf, (4,), np.float32)})
EPISODE_SPACE = Dict({"ret": Box(-np.inf, np.inf, (), np.float64)})
_DEADLINE_S = 60.0  # a child its parent forgot is gone after this


def episode_length(w: int, e: int) -> int:
    return 3 + (7 * w + 5 * e) % 11


def episode_rows(w: int, e: int) -> dict[str, np.ndarray]:
    n = episode_length(w, e)
    obs = np.stack([np.full(n, w), np.full(n, e), np.arange(n), np.full(n, n)], axis=1).astype(np.float32)
    return {"obs": obs}


def write_shard(root: str, name: str, w: int, episodes: int | None, log: str, ready: str,
                storage_options: Any = None, capacity: int | None = None) -> None:
    """Write episodes ``0 ..`` of writer ``w`` into shard ``name`` (a ring of ``capacity`` steps
    when given), flushing every 3 episodes and logging what each flush committed;
    ``episodes=None`` writes until killed."""
    kwargs: dict[str, Any] = {"storage_options": storage_options} if storage_options else {}
    if capacity is not None:
        kwargs["step_data_capacity"] = kwargs["episode_data_capacity"] = capacity
    buf = create_shard(root, SPACE, shard=name, episode_data_instance_space=EPISODE_SPACE, chunk_rows=64,
                       commit_interval=0.05, **kwargs)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    open(ready, "w").close()
    deadline = time.monotonic() + _DEADLINE_S
    e = steps = 0
    while (episodes is None or e < episodes) and time.monotonic() < deadline:
        rows = episode_rows(w, e)
        buf.extend(rows)
        buf.set_current_episode_data({"ret": np.float64(w * 1000 + e)})
        buf.mark_episode_end()
        e += 1
        steps += len(rows["obs"])
        if e % 3 == 0 or (episodes is not None and e == episodes):
            buf.flush()
            os.write(fd, f"F [{e}, {steps}]\n".encode())
    buf.close()


def write_rows(url: str, storage_options: Any, log: str, ready: str) -> None:
    """Append rows ``[seq, seq, seq, seq]`` (seq = 0, 1, ...) to a new ReplayBuffer at ``url`` in
    blocks of 50, flushing each block and logging ``F <rows committed>``; runs until killed."""
    from trajstore import ReplayBuffer

    buf = ReplayBuffer.create(Box(-np.inf, np.inf, (4,), np.float32), cache_path=url, storage_options=storage_options,
                              chunk_rows=64, commit_interval=3600)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    open(ready, "w").close()
    deadline = time.monotonic() + _DEADLINE_S
    n = 0
    while time.monotonic() < deadline:
        buf.extend(np.repeat(np.arange(n, n + 50, dtype=np.float32)[:, None], 4, axis=1))
        n += 50
        buf.flush()
        os.write(fd, f"F {n}\n".encode())


def create_shards(root: str, first: int, log: str, ready: str) -> None:
    """Create shards ``c<first>``, ``c<first+1>``, ... of 5 steps each (episode ``first``...) until
    killed, logging ``S <n>`` after shard ``n`` was closed (committed)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    open(ready, "w").close()
    deadline = time.monotonic() + _DEADLINE_S
    n = first
    while time.monotonic() < deadline:
        buf = create_shard(root, SPACE, shard=f"c{n:05d}", episode_data_instance_space=EPISODE_SPACE)
        buf.extend({"obs": np.full((5, 4), n, np.float32)})
        buf.close()
        os.write(fd, f"S {n}\n".encode())
        n += 1


def race_first_shard(root: str, name: str, width: int, go: str, result: str) -> None:
    """Wait for ``go``, then create shard ``name`` with ``obs`` of ``width`` floats; write the
    outcome (``ok`` or the error's class name) to ``result``."""
    space = Dict({"obs": Box(-np.inf, np.inf, (width,), np.float32)})
    deadline = time.monotonic() + _DEADLINE_S
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.0005)
    try:
        buf = create_shard(root, space, shard=name)
        buf.extend({"obs": np.ones((3, width), np.float32)})
        buf.close()
        outcome = "ok"
    except Exception as e:  # the parent checks which error
        outcome = type(e).__name__
    with open(result + ".tmp", "w") as f:
        f.write(outcome)
    os.replace(result + ".tmp", result)
