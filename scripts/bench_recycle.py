"""Recycled return batches (trajstore.images.set_batch_recycling): ``sample(256)`` of JPEG stores of
gymnasium renders with recycling on and off, against the codec's own decode loop into one array
(``bench_codecs.OwnLoop``), in interleaved blocks in one process (a shared machine's load hits
every variant alike), and ``sample(256)`` of raw (17,) float32 vectors (below the recycler's
threshold: what it must not slow down).

Each block: 2 untimed calls (a loop's steady state: the recycler holds the batches it cycles
through; off, glibc and the kernel do what they do on every call), then ``--calls`` timed calls
``batch = ro.sample(256)`` as a training loop makes them.  Variants per round, in rotating order:
recycling off / on with 1 and 2 decode threads, and the own loop.  Then "cold" rounds: the store
opened afresh and recycled memory released before each variant, its first ``--calls`` calls timed
(no untimed ones).  Ratios are medians over the rounds of the per-round ratios.

    python scripts/bench_recycle.py --sizes 84,480 --frames 1000 --rounds 7
    python scripts/bench_recycle.py --vectors-only   # the raw-vector timing alone (compare trees)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_codecs import BATCH, OwnLoop, renders

import trajstore.images as ti
from trajstore import ReplayBuffer


def _block(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` consecutive calls of ``fn`` (after 2 untimed ones), each result
    held until the next call returns, as ``batch = fn()`` holds it."""
    held = fn()
    held = fn()
    t = time.perf_counter()
    for _ in range(calls):
        held = fn()
    del held
    return (time.perf_counter() - t) / calls


def frames_bench(shape: tuple[int, int, int], n: int, rounds: int, calls: int, tmp: Path) -> dict[str, float]:
    frames = renders(n, shape)[0]
    assert frames is not None, "gymnasium renders need pygame"
    path = tmp / f"renders_{shape[0]}"
    with ReplayBuffer.create(gym.spaces.Box(0, 255, shape, np.uint8), cache_path=str(path), capacity=n,
                             compressor="jpeg:90") as w:
        for i in range(0, n, 500):
            w.extend(frames[i : i + 500])
    variants = ["off1", "on1", "off2", "on2", "own"]
    per: dict[str, list[float]] = {v: [] for v in variants}
    with ReplayBuffer.load_from(str(path), read_only=True) as ro:
        own, g = OwnLoop(path, "jpeg:90"), np.random.default_rng(0)
        for r in range(rounds):
            for v in variants[r % len(variants):] + variants[: r % len(variants)]:
                if v == "own":
                    per[v].append(_block(lambda: own.call(g.integers(0, n, size=BATCH)), calls))
                    continue
                ti.set_batch_recycling(v.startswith("on"))
                ti.set_decode_threads(int(v[-1]))
                per[v].append(_block(lambda: ro.sample(BATCH, rng=g), calls))
        own.close()
    ti.set_decode_threads(None)
    ti.set_batch_recycling(True)

    def ratio(a: str, b: str) -> float:  # frames/s of a over frames/s of b, per round
        return statistics.median(y / x for x, y in zip(per[a], per[b]))

    # Cold: the first ``calls`` calls after opening the store, recycled memory released before.
    cold: dict[str, list[float]] = {v: [] for v in variants[:4]}
    for r in range(rounds):
        for v in variants[r % 4 : 4] + variants[: r % 4]:
            ti.set_batch_recycling(v.startswith("on"))
            ti.release_recycled_batches()
            ti.set_decode_threads(int(v[-1]))
            with ReplayBuffer.load_from(str(path), read_only=True) as ro:
                t = time.perf_counter()
                for _ in range(calls):
                    batch = ro.sample(BATCH, rng=g)
                cold[v].append((time.perf_counter() - t) / calls)
                del batch
    ti.set_decode_threads(None)
    ti.set_batch_recycling(True)
    per |= {f"cold {v}": c for v, c in cold.items()}

    return {"cold off 2v1": ratio("cold off2", "cold off1"), "cold on 2v1": ratio("cold on2", "cold on1"),
            "cold off1/own": ratio("cold off1", "own"), "cold on1/own": ratio("cold on1", "own"),
            "ms_off1": 1e3 * statistics.median(per["off1"]), "ms_on1": 1e3 * statistics.median(per["on1"]),
            "ms_own": 1e3 * statistics.median(per["own"]),
            "off1/own": ratio("off1", "own"), "on1/own": ratio("on1", "own"),
            "off 2v1": ratio("off2", "off1"), "on 2v1": ratio("on2", "on1")}


def vectors_bench(rounds: int, calls: int, tmp: Path) -> float:
    """Median microseconds per ``sample(256)`` of a raw (17,) float32 store of 100,000 rows."""
    path = tmp / "vectors"
    with ReplayBuffer.create(gym.spaces.Box(-1, 1, (17,), np.float32), cache_path=str(path), capacity=100_000) as w:
        w.extend(np.random.default_rng(0).random((100_000, 17), np.float32))
    with ReplayBuffer.load_from(str(path), read_only=True) as ro:
        g = np.random.default_rng(0)
        return 1e6 * statistics.median(_block(lambda: ro.sample(BATCH, rng=g), calls * 50) for _ in range(rounds))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes", default="84,480", help="render sizes: 84 (84x84x3) and/or 480 (480x640x3)")
    ap.add_argument("--frames", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per block")
    ap.add_argument("--vectors-only", action="store_true")
    a = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start; trajstore from {ti.__file__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_recycle_") as d:
        tmp = Path(d)
        if not a.vectors_only:
            for s in a.sizes.split(","):
                shape = (84, 84, 3) if s == "84" else (480, 640, 3)
                got = frames_bench(shape, a.frames, a.rounds, a.calls, tmp)
                print(f"renders {'x'.join(map(str, shape))}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()),
                      flush=True)
        print(f"raw (17,) float32 sample(256): {vectors_bench(a.rounds, a.calls, tmp):.1f} us a call", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
