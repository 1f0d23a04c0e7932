"""Child-process code for tests/test_episode_edit.py: a writer that removes episodes in pairs
with ``remove_episodes`` and records new pairs, until it is SIGKILLed.

Steps are encoded by ``_traj_workers.encode_steps(episode id, step number)``; the data of an
episode is ``[episode id, pair id, length, 1.0]``, so a parent that reopens the store can check
every episode it sees is whole (all its steps, in order, with its data) and that the two
episodes of a pair are both present or both gone (one ``remove_episodes`` call removes both).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from gymnasium.spaces import Box

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _traj_workers as TW  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402

STEP_SPACE = TW.STEP_SPACE
EP_SPACE = Box(-np.inf, np.inf, (4,), np.float64)  # [eid, pair, length, 1.0]


def record_pair(rb: TrajectoryReplayBuffer, rng: np.random.Generator) -> None:
    """Two episodes of random length that share a pair id (the first one's episode id)."""
    pair = rb.current_episode_id
    for _ in range(2):
        eid = rb.current_episode_id
        length = int(rng.integers(2, 40))
        rb.extend(TW.encode_steps(np.full(length, eid), np.arange(length)))
        rb.set_current_episode_data(np.array([eid, pair, length, 1.0]))
        rb.mark_episode_end()


def remove_pairs_loop(store: str, ready: str, seed: int, deadline_s: float = 60.0) -> None:
    """Open ``store`` as the writer; remove a random pair of episodes, record a new pair; repeat
    until SIGKILLed."""
    rng = np.random.default_rng(seed)
    rb = TrajectoryReplayBuffer.load_from(store)
    W.touch(ready)
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        eps = rb.episodes()["episode_id"]
        data = np.asarray(rb.get_at(rb.episodes()["start"])["episode_data"])
        pairs = np.unique(data[:, 1].astype(np.int64))
        if len(pairs) > 4:
            p = int(rng.choice(pairs))
            rb.remove_episodes(eps[data[:, 1].astype(np.int64) == p])
        record_pair(rb, rng)
    os._exit(0)
