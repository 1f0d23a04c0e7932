"""Write cost of commits that change an unbounded store's row count (plain-reader metadata).

Every commit that changes the rows of an unbounded table also rewrites its arrays' ``zarr.json``
shapes and the consolidated metadata (docs/format.md, "What plain zarr readers see").  This
measures what that costs, as ratios against baselines run in the same process:

- ``extend(64) + flush`` on an unbounded store (each call commits new rows) against the same
  calls on a ring of the same fields (its shapes never change: no metadata rewrite);
- ``extend(64)`` alone on the unbounded store (the hot path: a commit only every
  ``commit_interval`` seconds) against writing the same rows into numpy memmaps.

    python scripts/bench_commit.py [--calls 2000] [--dir /tmp]

Timed in blocks of consecutive calls (:func:`bench_core.run_blocks`), no warm-up pass: "cold" is
the first 200 calls after opening, "steady" the rest.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import BLOCK, COLD, run_blocks  # noqa: E402

from trajstore import ReplayBuffer  # noqa: E402

BATCH = 64


def _space() -> gym.spaces.Dict:
    """An SB3-like transition: obs/next_obs (17,) f32, action (6,) f32, reward, done."""
    return gym.spaces.Dict({
        "obs": gym.spaces.Box(-10, 10, (17,), np.float32), "next_obs": gym.spaces.Box(-10, 10, (17,), np.float32),
        "action": gym.spaces.Box(-1, 1, (6,), np.float32), "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32),
        "done": gym.spaces.Box(0, 1, (), np.float32)})


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"obs": rng.standard_normal((BATCH, 17)).astype(np.float32),
            "next_obs": rng.standard_normal((BATCH, 17)).astype(np.float32),
            "action": rng.uniform(-1, 1, (BATCH, 6)).astype(np.float32),
            "reward": np.ones(BATCH, np.float32), "done": np.zeros(BATCH, np.float32)}


def _rows(what: str, times: dict[str, np.ndarray], ours: str, base: str) -> list[dict[str, Any]]:
    a, b = times[ours], times[base]
    return [{"what": what, "phase": phase, "ours": a[sl].sum() / n * 1e6, "base": b[sl].sum() / n * 1e6,
             "base_name": base, "ratio": a[sl].sum() / b[sl].sum()}
            for phase, sl, n in (("cold", slice(0, COLD), COLD), ("steady", slice(COLD, None), len(a) - COLD))]


def bench(tmp: Path, calls: int) -> list[dict[str, Any]]:
    batch = _batch()
    rows = calls * BATCH
    # commit_interval large: only the explicit flush commits (the hot-path rows below: never).
    opts = {"commit_interval": 1e9}
    unbounded = ReplayBuffer.create(_space(), cache_path=tmp / "unbounded", overwrite=True, **opts)
    ring = ReplayBuffer.create(_space(), cache_path=tmp / "ring", capacity=rows + BATCH, overwrite=True, **opts)

    def ub_flush() -> None:
        unbounded.extend(batch)
        unbounded.flush()

    def ring_flush() -> None:
        ring.extend(batch)
        ring.flush()

    out = _rows("extend(64) + flush, unbounded vs ring", run_blocks({"ours": ub_flush, "ring": ring_flush}, calls),
                "ours", "ring")
    unbounded.close()
    ring.close()

    hot = ReplayBuffer.create(_space(), cache_path=tmp / "hot", overwrite=True, **opts)
    mm = {k: np.lib.format.open_memmap(tmp / f"mm_{k}.npy", mode="w+", dtype=v.dtype, shape=(rows, *v.shape[1:]))
          for k, v in batch.items()}
    pos = [0]

    def memmap() -> None:
        i = pos[0]
        for k, v in batch.items():
            mm[k][i:i + BATCH] = v
        pos[0] = i + BATCH

    out += _rows("extend(64), unbounded vs memmap", run_blocks({"ours": lambda: hot.extend(batch), "memmap": memmap},
                                                                 calls), "ours", "memmap")
    hot.close()
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| workload | phase | trajstore us/call | baseline us/call | baseline | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['phase']} | {r['ours']:.1f} | {r['base']:.1f} | {r['base_name']} | "
                     f"{r['ratio']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help=f"calls per system (blocks of {BLOCK}; first {COLD} cold)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(table(bench(Path(d), max(args.calls, COLD + BLOCK))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
