"""How full does a live ring look to a reader?  (docs/reliability.md, docs/design.md 3.8)

One writer process appends single rows as fast as it can to a full ring; this process opens the
store read-only and polls ``len()`` and ``sample(32)`` for the same time.  Prints, per capacity,
the writer's rate, the reader's smallest and median ``len`` as a share of the capacity, the share of
polls below 95 % full, and how many samples raised.  The documented bound is
``capacity - 2 * min(capacity // 32, 4096)`` rows (at least 15/16 full).

    python scripts/ring_fullness.py                      # capacities 1,000 and 20,000, 4 s each
    python scripts/ring_fullness.py --capacity 100000 --seconds 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time

import gymnasium as gym
import numpy as np

from trajstore import ReplayBuffer

SPACE = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)


def _writer(path: str, seconds: float, rate_file: str) -> None:
    rb = ReplayBuffer.load_from(path)
    row = np.ones(4, np.float32)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        rb.append(row)
        n += 1
    rb.close()
    with open(rate_file, "w") as f:
        f.write(str(n / seconds))


def measure(capacity: int, seconds: float, root: str) -> dict[str, float]:
    """Fill a ring of ``capacity`` rows, then poll it from a reader while a writer appends."""
    path = os.path.join(root, f"ring{capacity}")
    rb = ReplayBuffer.create(SPACE, cache_path=path, capacity=capacity, overwrite=True)
    rb.extend(np.zeros((capacity, 4), np.float32))
    rb.close()
    rate_file = path + ".rate"
    w = multiprocessing.get_context("spawn").Process(target=_writer, args=(path, seconds, rate_file))
    w.start()
    lens, errors = [], 0
    with ReplayBuffer.load_from(path, read_only=True) as ro:
        while not os.path.exists(rate_file) and w.is_alive():
            lens.append(len(ro))
            try:
                ro.sample(32)
            except Exception:  # noqa: BLE001 (counted: a reader of a full ring must never fail)
                errors += 1
    w.join()
    a = np.asarray(lens) / capacity
    with open(rate_file) as f:
        rate = float(f.read())
    return {"capacity": capacity, "writer_rows_per_s": rate, "polls": len(a), "min_full": float(a.min()),
            "median_full": float(np.median(a)), "below_95pct": float((a < 0.95).mean()), "sample_errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, action="append", help="ring capacity (repeatable)")
    parser.add_argument("--seconds", type=float, default=4.0, help="writer run time per capacity")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a reader saw the ring below the documented bound or a sample failed")
    args = parser.parse_args()
    failed = False
    root = tempfile.mkdtemp(prefix="trajstore-ring-")
    try:
        for cap in args.capacity or [1_000, 20_000]:
            r = measure(cap, args.seconds, root)
            print(f"capacity {r['capacity']:>9,}: writer {r['writer_rows_per_s']:>9,.0f} rows/s; reader "
                  f"{r['polls']:,} polls, len min {r['min_full']:.1%} median {r['median_full']:.1%} of capacity, "
                  f"{r['below_95pct']:.1%} of polls below 95 %, {r['sample_errors']} sample errors")
            bound = (cap - 2 * max(1, min(cap // 32, 4096))) / cap
            failed |= r["min_full"] < bound or r["sample_errors"] > 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.check and failed:
        raise SystemExit("a reader saw the ring below capacity - 2 * guard rows, or a sample failed")


if __name__ == "__main__":
    main()
