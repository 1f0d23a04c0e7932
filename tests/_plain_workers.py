"""Child program of ``test_plain_readers.py``: a writer of an unbounded store that grows, shrinks
(``remove_at``, ``clear``) and commits until SIGKILLed, so the parent can check what plain zarr
readers see after a kill at any instant.  Rows are ``_workers.encode`` of a sequence number."""

from __future__ import annotations

import os
import time

import _workers as W
import numpy as np

from trajstore import ReplayBuffer

_DEADLINE_S = 30.0  # a child the parent forgot is gone after this


def shrink_grow_program(store: str, ready: str, seed: int) -> None:
    """Extend (1-700 rows: chunk and allocation boundaries are crossed), flush, and now and then
    remove rows (the table shrinks and its chunks are rewritten) or clear the store."""
    rng = np.random.default_rng(seed)
    rb = ReplayBuffer.load_from(store, commit_interval=0.0)  # every write commits: kills land around records
    seq = 10_000 * seed
    W.touch(ready)
    t_end = time.monotonic() + _DEADLINE_S
    while time.monotonic() < t_end:
        r = rng.random()
        if r < 0.7:
            b = int(rng.integers(1, 700))
            rb.extend(W.encode(np.arange(seq, seq + b)))
            seq += b
        elif r < 0.85:
            rb.flush()
        elif r < 0.97 and len(rb) > 2:
            rb.remove_at(rng.choice(len(rb), size=min(len(rb) - 1, int(rng.integers(1, 50))), replace=False))
        else:
            rb.clear()
    os._exit(3)
