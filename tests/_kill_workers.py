"""Child programs of ``test_kill_loops.py``: writers that run every write path until SIGKILLed.

Each program opens an existing store as its writer, touches ``ready``, then loops random
operations drawn from ``seed`` forever.  What it has *acknowledged* (a call returned) is
appended to ``log`` with one ``os.write`` per line, so the parent can parse it after a SIGKILL
(a torn last line is ignored):

``F <rows>``
    ``flush()`` returned: rows ``0 .. rows - 1`` of the append sequence are committed.
``D <json>``
    a rewrite program's operation returned (flushed): the store's content is that state.
``I <json>``
    a rewrite program is about to run this operation.

Row contents come from ``_workers.encode`` (append programs: absolute sequence number) and
``_workers.encode_kv`` (rewrite programs: key and version), so the parent checks every row it
reads without knowing the writer's timing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import _workers as W
import numpy as np
from gymnasium.spaces import Box, Dict

from trajstore import ReplayBuffer, TrajectoryReplayBuffer

EPISODE_SPACE = Dict({"ret": Box(-np.inf, np.inf, (), np.float64)})
_DEADLINE_S = 120.0  # a child the parent forgot is gone after this (30 s was reached once on cores loaded to 11)


class _Log:
    """Append-only acknowledgement log (one ``write`` per line: a kill never tears two lines)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, tag: str, value: Any) -> None:
        os.write(self.fd, f"{tag} {json.dumps(value)}\n".encode())


def parse_log(path: str) -> list[tuple[str, Any]]:
    """``(tag, value)`` of every complete line of ``path`` (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, "rb") as f:
        for line in f.read().split(b"\n"):
            tag, _, rest = line.decode(errors="replace").partition(" ")
            try:
                out.append((tag, json.loads(rest)))
            except ValueError:
                continue  # the torn last line of a killed child
    return out


def next_seq(rb: Any) -> int:
    """The next append sequence number: one past the last row's (0 for an empty store)."""
    n = len(rb)
    if n == 0:
        return 0
    last = rb[n - 1]
    step = last["step_data"] if "step_data" in last else last
    seq, ok = W.decode(W.batched(step))
    assert ok[0], "the last row of the store is damaged"
    return int(seq[0]) + 1


def append_program(store: str, log: str, ready: str, seed: int, kind: str, max_batch: int) -> None:
    """``kind`` "replay" (ReplayBuffer) or "trajectory" (TrajectoryReplayBuffer with episode data
    whose ``ret`` is the episode's own id): append, extend (up to ``max_batch`` rows, more than a
    ring's capacity at times), flush, and for trajectories mark_episode_end and episode data."""
    rng = np.random.default_rng(seed)
    ack = _Log(log)
    traj = kind == "trajectory"
    rb = TrajectoryReplayBuffer.load_from(store) if traj else ReplayBuffer.load_from(store)
    seq = next_seq(rb)
    W.touch(ready)
    t_end = time.monotonic() + _DEADLINE_S
    while time.monotonic() < t_end:
        r = rng.random()
        if r < 0.45:
            rb.append(W.one(W.encode([seq])))
            seq += 1
        elif r < 0.8:
            b = int(rng.integers(2, max_batch + 1))
            rb.extend(W.encode(np.arange(seq, seq + b)))
            seq += b
        elif r < 0.9 or not traj:
            rb.flush()
            ack("F", seq)
        elif r < 0.95:
            rb.set_current_episode_data({"ret": np.float64(rb.current_episode_id)})
        else:
            rb.mark_episode_end()
    os._exit(3)


def rewrite_program(store: str, log: str, ready: str, seed: int) -> None:
    """An unbounded ReplayBuffer of ``encode_kv`` rows, changed by set_at (a new version of
    random rows), remove_at, clear and flushed appends; every operation is logged (``I``) before
    it runs and acknowledged (``D`` with the resulting (key, version) list) after it returned."""
    rng = np.random.default_rng(seed)
    ack = _Log(log)
    rb = ReplayBuffer.load_from(store)
    x = rb[:] if len(rb) else None
    state = [] if x is None else [list(map(int, kv)) for kv in zip(*W.decode_kv(x)[:2])]
    next_key = 1 + max((k for k, _v in state), default=0)
    W.touch(ready)
    t_end = time.monotonic() + _DEADLINE_S
    while time.monotonic() < t_end:
        r = rng.random()
        if r < 0.35 or len(state) < 4:
            b = int(rng.integers(1, 40))
            keys = list(range(next_key, next_key + b))
            op = ["extend", keys]
            new = state + [[k, 0] for k in keys]
        elif r < 0.7:
            idx = sorted(set(rng.integers(0, len(state), size=int(rng.integers(1, 6))).tolist()))
            op = ["set_at", idx]
            new = [[k, v + 1] if i in idx else [k, v] for i, (k, v) in enumerate(state)]
        elif r < 0.97:
            idx = sorted(set(rng.integers(0, len(state), size=int(rng.integers(1, 6))).tolist()))
            op = ["remove_at", idx]
            new = [kv for i, kv in enumerate(state) if i not in idx]
        else:
            op, new = ["clear"], []
        ack("I", op)
        if op[0] == "extend":
            rb.extend(W.encode_kv(op[1], 0))
            next_key += len(op[1])
        elif op[0] == "set_at":
            rb.set_at(np.array(op[1]), W.encode_kv([state[i][0] for i in op[1]], [state[i][1] + 1 for i in op[1]]))
        elif op[0] == "remove_at":
            rb.remove_at(np.array(op[1]))
        else:
            rb.clear()
        rb.flush()
        state = new
        ack("D", state)
    os._exit(3)


def copy_program(store: str, log: str, ready: str, seed: int, targets: list[str]) -> None:
    """Open ``store`` as its writer and copy it, again and again, to one of ``targets``: through
    ``dumps(path)`` and through the CLI's ``copy`` (in-process ``trajstore.cli.main``); with a few
    appends and flushes in between, so the copies differ."""
    from trajstore.cli import main

    rng = np.random.default_rng(seed)
    ack = _Log(log)
    rb = ReplayBuffer.load_from(store)
    seq = next_seq(rb)
    W.touch(ready)
    t_end = time.monotonic() + _DEADLINE_S
    while time.monotonic() < t_end:
        target = targets[int(rng.integers(0, len(targets)))]
        r = rng.random()
        if r < 0.4:
            rb.dumps(target)
        elif r < 0.7:
            rb.flush()
            rc = main(["copy", store, target, "--overwrite"])
            assert rc == 0, f"trajstore copy exited {rc}"
        else:
            b = int(rng.integers(1, 200))
            rb.extend(W.encode(np.arange(seq, seq + b)))
            seq += b
            rb.flush()
            ack("F", seq)
    os._exit(3)


def repair_program(store: str, log: str, ready: str, seed: int) -> None:
    """Run ``repair_store`` (deep, and not) on ``store`` over and over (the parent damages the
    store between rounds, so there is work to do)."""
    from trajstore import repair_store

    rng = np.random.default_rng(seed)
    W.touch(ready)
    t_end = time.monotonic() + _DEADLINE_S
    while time.monotonic() < t_end:
        repair_store(store, deep=bool(rng.random() < 0.5))
    os._exit(3)


def sb3_program(store: str, log: str, ready: str, seed: int) -> None:
    """stable-baselines3's ``add`` on a ``ZarrReplayBuffer`` at ``store`` (reopened with every
    committed transition), with observations that encode their transition number."""
    import gymnasium as gym

    from trajstore.sb3 import ZarrReplayBuffer

    rng = np.random.default_rng(seed)
    ack = _Log(log)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)
    act_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    rb = ZarrReplayBuffer(SB3_CAPACITY, obs_space, act_space, device="cpu", n_envs=2, cache_path=store, resume=True,
                          commit_interval=0.02)
    seq = int(np.asarray(rb.observations)[(rb.pos - 1) % rb.buffer_size, 0, 0]) + 1 if rb.size() else 0
    W.touch(ready)
    t_end = time.monotonic() + _DEADLINE_S
    while time.monotonic() < t_end:
        o = sb3_obs(seq)
        rb.add(o, o + 0.5, rng.uniform(-1, 1, (2, 2)).astype(np.float32), np.full(2, seq, np.float32),
               np.zeros(2, bool), [{}, {}])
        seq += 1
        if rng.random() < 0.02:
            rb.flush()
            ack("F", seq)
    os._exit(3)


SB3_CAPACITY = 600  # transitions over 2 envs: 300 rows per env, so the ring wraps within a round


def sb3_obs(seq: int) -> np.ndarray:
    """(2, 5) float32 observation of transition ``seq`` (env e holds ``seq + e / 4``)."""
    return (np.float32(seq) + np.arange(2, dtype=np.float32)[:, None] / 4) * np.ones((2, 5), np.float32)
