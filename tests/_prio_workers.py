"""Child-process code for ``test_prioritized.py`` (module level, picklable arguments: runs under
spawn and forkserver).  Results go to files replaced atomically (temp + ``os.replace``)."""

from __future__ import annotations

import os

import numpy as np


def _save(path: str, **arrays: np.ndarray) -> None:
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def row_priority(rows: np.ndarray) -> np.ndarray:
    """The priority the kill loop gives absolute row ``a`` (never 1.0 or the max, 13.25)."""
    return (np.asarray(rows) % 13) + 0.25


def read_priorities(path: str, out: str) -> None:
    """Open the buffer read-only here, and save what a sampler over it sees."""
    from trajstore import PrioritizedSampler, ReplayBuffer

    buf = ReplayBuffer.load_from(path, read_only=True)
    s = PrioritizedSampler(buf)
    idx = np.arange(len(buf))
    _save(out, priorities=s.priorities(idx), probabilities=s.probabilities(idx),
          rows=np.asarray(buf[idx]).reshape(len(idx), -1)[:, 0], max_priority=np.array(s.max_priority))
    s.close()
    buf.close()


def update_loop(path: str, progress: str) -> None:
    """Writer: append rows (value = absolute row number), sample, and set every live row's priority
    to ``row_priority(row)``, flushing the priorities after every update (``flush_interval=0``).
    After each flush, ``progress`` names the absolute rows whose priorities were committed."""
    from trajstore import PrioritizedSampler, ReplayBuffer

    buf = ReplayBuffer.load_from(path)
    s = PrioritizedSampler(buf, flush_interval=0.0)
    rng = np.random.default_rng(os.getpid())
    while True:
        src = buf.row_source()
        start = src.start + len(buf)
        n = int(rng.integers(1, 300))
        buf.extend(np.arange(start, start + n, dtype=np.float64)[:, None])
        s.sample(32, rng=rng)
        rows = np.arange(len(buf))
        s.update_priorities(rows, row_priority(rows + src.start))  # flushes (interval 0)
        lo, hi = src.committed
        _save(progress, lo=np.array(lo), hi=np.array(hi))
