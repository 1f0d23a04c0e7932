"""Child processes of tests/test_robot.py (importable, so they start under spawn as well as fork)."""

from __future__ import annotations

import numpy as np

from trajstore import TrajectoryReplayBuffer


def edit_robot_loop(store: str, ready: str, seed: int) -> None:
    """Rename, reassign and save statistics for ever, until SIGKILLed."""
    rng = np.random.default_rng(seed)
    with TrajectoryReplayBuffer.load_from(store) as tb:
        k = 0
        while True:
            names = tb.tasks
            tb.rename_task(names[0], f"task {k}")
            tb.assign_task(rng.integers(0, 6, size=3).tolist(), tb.tasks[int(rng.integers(0, len(tb.tasks)))])
            tb.save_stats()
            if k == 0:
                open(ready, "w").close()
            k += 1
