"""SB3's ``ZarrReplayBuffer`` with an image codec (issue 31): a writer adding frames (encoded as
their shards are written) SIGKILLed while its ring wraps; the buffer resumes with consecutive,
exact (lossless codec) transitions, nothing flushed lost, and the store verifies."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("imagecodecs")
pytest.importorskip("stable_baselines3")

CAPACITY = 96  # rows per env: the ring wraps within a round

def _writer(store: str, log: str, ready: str) -> None:
    """Adds transitions (frames that encode their number) with a flush now and then, for ever."""
    import gymnasium as gym

    from trajstore.sb3 import ZarrReplayBuffer

    rb = ZarrReplayBuffer(CAPACITY, gym.spaces.Box(0, 255, (24, 24, 3), np.uint8), gym.spaces.Discrete(3), "cpu",
                          cache_path=store, resume=True, compressor={"obs": "png"}, commit_interval=0.02,
                          optimize_memory_usage=True, handle_timeout_termination=False)
    seq = int(rb.rewards[(rb.pos - 1) % rb.buffer_size, 0]) + 1 if rb.size() else 0
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    open(ready, "w").close()
    rng = np.random.default_rng(seq)
    while True:
        rb.add(frame(seq)[None], frame(seq + 1)[None], np.zeros((1, 1)), np.full(1, float(seq)), np.zeros(1), [{}])
        seq += 1
        if rng.random() < 0.05:
            rb.flush()
            os.write(fd, f"{seq}\n".encode())


def frame(t: int) -> np.ndarray:
    """A (24, 24, 3) uint8 frame that depends on ``t`` only."""
    y, x = np.mgrid[0:24, 0:24]
    return np.stack([((x * 7 + y * 3 + t * 11 + c * 50) % 256).astype(np.uint8) for c in range(3)], -1)


def test_sigkill_during_adds_of_an_image_codec_ring(tmp_path):
    import gymnasium as gym

    from trajstore.maintenance.verify import verify_store
    from trajstore.sb3 import ZarrReplayBuffer

    store, log = tmp_path / "b", tmp_path / "log"
    kw = {"cache_path": str(store), "compressor": {"obs": "png"}, "optimize_memory_usage": True,
          "handle_timeout_termination": False}
    spaces = (gym.spaces.Box(0, 255, (24, 24, 3), np.uint8), gym.spaces.Discrete(3))
    ZarrReplayBuffer(CAPACITY, *spaces, "cpu", **kw).close()
    end = 0
    for r in range(3):
        ready = tmp_path / f"ready{r}"
        # Forked from this process, which has imported torch and stable-baselines3 already.
        p = multiprocessing.get_context("fork").Process(target=_writer, args=(str(store), str(log), str(ready)))
        p.start()
        try:
            deadline = time.monotonic() + 90
            while not ready.exists() and p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.4 + 0.3 * r)
            assert p.is_alive(), "the writer died before it was killed"
            os.kill(p.pid, signal.SIGKILL)
        finally:
            p.kill()
            p.join(30)
        assert p.exitcode == -signal.SIGKILL
        flushed = max([int(x) for x in log.read_text().split()] or [0]) if log.exists() else 0
        report = verify_store(str(store / "transitions"), deep=True)
        assert report.ok, report
        rb = ZarrReplayBuffer(CAPACITY, *spaces, "cpu", resume=True, **kw)
        try:
            n = rb.size()
            rows = (rb.pos - n + np.arange(n)) % CAPACITY  # oldest first
            seq = rb.rewards[rows, 0].astype(np.int64)
            assert n == 0 or (np.diff(seq) == 1).all(), f"round {r}: transitions are not consecutive"
            new_end = int(seq[-1]) + 1 if n else 0
            assert new_end >= flushed, f"round {r}: flushed transitions lost ({new_end} < {flushed})"
            assert new_end >= end
            s = rb.sample(32)
            ts = s.rewards.numpy().ravel().astype(int)
            assert np.array_equal(s.observations.numpy(), np.stack([frame(t)[None] for t in ts]).reshape(
                s.observations.shape)), f"round {r}: frames differ"
            end = new_end
        finally:
            rb.close()
    assert end > CAPACITY, f"only {end} transitions: the ring did not wrap"
