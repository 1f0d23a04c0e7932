"""Sharded-dataset benchmark: sample(256) and sample_sequences(256, 8) over a dataset split into
S shards, as ratios against one store holding the same rows, run in the same process.

    python scripts/bench_shards.py            # 200,000 steps of (17,) f32, 1 / 4 / 16 / 64 shards
    python scripts/bench_shards.py --quick    # 20,000 steps (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).

Every system is opened just before the timed calls; ``bench_core.run_blocks`` runs them in blocks
of consecutive calls, the order rotated; *cold* is the mean of the first 200 calls after opening
(no warm-up pass), *steady* the mean of the rest.  A ratio near 1 means the shards cost nothing
beyond one store; the issue's bound is O(log shards) per draw (the last column: steady time
relative to the 1-shard dataset, the cost the number of shards adds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gymnasium.spaces import Box, Dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import BLOCK, COLD, run_blocks  # noqa: E402
from benchdoc import cold_steady_note, section  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.shards import create_shard, open_sharded  # noqa: E402

SPACE = Dict({"obs": Box(-np.inf, np.inf, (17,), np.float32), "reward": Box(-np.inf, np.inf, (), np.float32)})
EPISODE = 200


def _fill(buf: Any, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for lo in range(0, n, EPISODE):
        k = min(EPISODE, n - lo)
        buf.extend({"obs": rng.standard_normal((k, 17), np.float32), "reward": rng.standard_normal(k, np.float32)})
        buf.mark_episode_end()
    buf.close()


def build(folder: Path, rows: int, shard_counts: list[int]) -> dict[str, str]:
    """One store and one sharded dataset per shard count, each holding ``rows`` steps."""
    paths = {"one store": str(folder / "single")}
    _fill(TrajectoryReplayBuffer.create(SPACE, cache_path=paths["one store"]), rows, 0)
    for s in shard_counts:
        root = str(folder / f"sharded-{s}")
        for k in range(s):
            n = rows // s + (1 if k < rows % s else 0)
            _fill(create_shard(root, SPACE, shard=f"shard-{k:04d}"), n, k)
        paths[f"{s} shards"] = root
    return paths


def measure(paths: dict[str, str], calls: int) -> dict[str, dict[str, np.ndarray]]:
    """Seconds per call of each workload on each system (all opened right before timing)."""
    out = {}
    for workload in ("sample(256)", "sample_sequences(256, 8)"):
        systems: dict[str, Callable[[], Any]] = {}
        for name, path in paths.items():
            ds = (TrajectoryReplayBuffer.load_from(path, read_only=True) if name == "one store"
                  else open_sharded(path))
            rng = np.random.default_rng(1)
            if workload == "sample(256)":
                systems[name] = lambda ds=ds, rng=rng: ds.sample(256, rng=rng)
            else:
                systems[name] = lambda ds=ds, rng=rng: ds.sample_sequences(256, 8, rng=rng)
        out[workload] = run_blocks(systems, calls)
    return out


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20,000 steps, 300 calls, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="fresh opens per system (default 5)")
    ap.add_argument("--dir", help="folder for the stores (default: a temp folder)")
    args = ap.parse_args(argv)
    rows, calls = (20_000, 300) if args.quick else (200_000, 1000)
    rounds = args.rounds or (2 if args.quick else 5)
    shard_counts = [1, 4, 16, 64]
    per_round: list[dict[tuple[str, str], tuple[float, float]]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        paths = build(Path(tmp), rows, shard_counts)
        for _ in range(rounds):
            res = measure(paths, calls)
            per_round.append({(w, name): (float(t[:COLD].mean()), float(t[COLD:].mean()))
                              for w, times in res.items() for name, t in times.items()})
    med = {k: (statistics.median(r[k][0] for r in per_round), statistics.median(r[k][1] for r in per_round))
           for k in per_round[0]}
    lines = ["| workload | system | cold ms | steady ms | cold vs one store | steady vs one store | "
             "steady vs 1 shard |", "|---|---|---|---|---|---|---|"]
    for workload in dict.fromkeys(w for w, _ in med):
        b_cold, b_steady = med[(workload, "one store")]
        one_shard = med[(workload, f"{shard_counts[0]} shards")][1]
        for (w, name), (cold, steady) in med.items():
            if w != workload:
                continue
            vs = f"{steady / one_shard:.2f}x" if name != "one store" else "-"
            lines.append(f"| {workload} | {name} | {cold * 1e3:.3f} | {steady * 1e3:.3f} | {cold / b_cold:.2f}x | "
                         f"{steady / b_steady:.2f}x | {vs} |")
    body = (f"A dataset of {rows:,} steps ((17,) f32 and a reward) split into 1 to 64 shards (`open_sharded`) "
            "against one `TrajectoryReplayBuffer` holding the same steps, every system opened just before its "
            "calls. " + cold_steady_note(BLOCK, COLD) + " The bound is O(log shards) per draw: the last column "
            "is the cost the number of shards adds.\n\n" + "\n".join(lines))
    return section("Sharded datasets (scripts/bench_shards.py)", "bench_shards.py", argv,
                   runs=f"every figure is the median of {rounds} rounds (fresh opens).", body=body,
                   quick=args.quick, started=started)


if __name__ == "__main__":
    print(main())
