"""Prioritized replay benchmark: ``PrioritizedSampler.sample(256)`` against the buffer's uniform
``sample(256)`` on the same store (target: within 2x at 1,000,000 vector rows), and the sum
tree's build time at 10,000,000 rows.

    python scripts/bench_prioritized.py                                # 1e6 rows, tree build at 1e7
    python scripts/bench_prioritized.py --quick                        # small sizes (smoke test)

The store holds transitions of (17,) float32 observations (obs, next_obs, (6,) action, reward,
done; raw chunks), as in bench_core.py, every row with a random priority (written through the
sampler and flushed to the store).  Calls are timed in blocks of 25 consecutive calls
(``bench_core.run_blocks``).  Cold: the mean of the first 200 calls after opening, each system
with a buffer opened for it alone (a fresh open maps the store anew, and its first reads fault the
pages in: sharing one buffer would hand those faults to whichever system runs first), the two
taking turns over three rounds.  Steady: both on one buffer, blocks interleaved and the order
rotated each round, the calls after the first 200.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import BLOCK, COLD, run_blocks  # noqa: E402
from benchdoc import section  # noqa: E402

from trajstore import PrioritizedSampler, ReplayBuffer  # noqa: E402
from trajstore.sampling.sumtree import SumTree  # noqa: E402

HEADING = "## Prioritized replay (scripts/bench_prioritized.py)"


def _space() -> gym.spaces.Dict:
    obs = gym.spaces.Box(-np.inf, np.inf, (17,), np.float32)
    return gym.spaces.Dict({
        "obs": obs, "next_obs": obs, "action": gym.spaces.Box(-1, 1, (6,), np.float32),
        "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32), "done": gym.spaces.Box(0, 1, (), np.float32),
    })


def build_store(path: Path, rows: int) -> None:
    """``rows`` random transitions, and a random priority for every row (stored in the sidecar)."""
    rng = np.random.default_rng(0)
    with ReplayBuffer.create(_space(), cache_path=str(path), capacity=rows) as buf:
        step = 100_000
        for lo in range(0, rows, step):
            n = min(step, rows - lo)
            buf.extend({"obs": rng.standard_normal((n, 17), np.float32),
                        "next_obs": rng.standard_normal((n, 17), np.float32),
                        "action": rng.uniform(-1, 1, (n, 6)).astype(np.float32),
                        "reward": rng.standard_normal(n, np.float32), "done": np.zeros(n, np.float32)})
        with PrioritizedSampler(buf, flush_interval=None) as s:
            s.sample(1, rng=0)
            s.update_priorities(np.arange(rows), rng.exponential(1.0, rows))


def bench_cold(path: Path, rounds: int = 3) -> tuple[float, float]:
    """Mean seconds of the first :data:`COLD` calls after opening: (prioritized, uniform), each
    with a buffer of its own, opened just before, the order alternated each round."""
    got: dict[str, list[float]] = {"prioritized": [], "uniform": []}
    for r in range(rounds):
        for name in (["prioritized", "uniform"] if r % 2 == 0 else ["uniform", "prioritized"]):
            rng = np.random.default_rng(10 + r)
            with ReplayBuffer.load_from(str(path)) as buf:
                if name == "prioritized":
                    with PrioritizedSampler(buf, flush_interval=None) as s:
                        t = run_blocks({name: lambda: s.sample(256, rng=rng)}, COLD)[name]
                else:
                    t = run_blocks({name: lambda: buf.sample(256, rng=rng)}, COLD)[name]
            got[name].append(float(t.mean()))
    return statistics.mean(got["prioritized"]), statistics.mean(got["uniform"])


def bench_sampling(path: Path, calls: int) -> tuple[list[tuple[str, float, float]], float]:
    """(what, prioritized ms, uniform ms) rows, and the sampler's open time in seconds."""
    cold = bench_cold(path)
    rng_u, rng_p = np.random.default_rng(1), np.random.default_rng(2)
    with ReplayBuffer.load_from(str(path)) as buf:
        t = time.perf_counter()
        s = PrioritizedSampler(buf, flush_interval=None)
        opened = time.perf_counter() - t
        times = run_blocks({"prioritized": lambda: s.sample(256, rng=rng_p),
                            "uniform": lambda: buf.sample(256, rng=rng_u)}, calls)
        state: dict[str, Any] = {}

        def cycle() -> None:  # a training step: sample, then new priorities for the batch
            _b, idx, _w = s.sample(256, rng=rng_p)
            s.update_priorities(idx, rng_p.exponential(1.0, 256))
            state["n"] = state.get("n", 0) + 1

        cyc = run_blocks({"cycle": cycle, "uniform": lambda: buf.sample(256, rng=rng_u)}, max(calls // 2, BLOCK))
        s.close()
    rows = [("sample(256), cold", *cold),
            ("sample(256), steady", times["prioritized"][COLD:].mean(), times["uniform"][COLD:].mean()),
            ("sample(256) + update_priorities(256), steady", cyc["cycle"].mean(), cyc["uniform"].mean())]
    return rows, opened


def bench_build(n: int, repeats: int) -> float:
    """Median seconds to build a sum tree of ``n`` leaves from their weights (allocation included)."""
    w = np.random.default_rng(3).exponential(1.0, n)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        tree = SumTree(n)
        tree.build(w)
        times.append(time.perf_counter() - t)
        assert np.isclose(tree.total, w.sum())
    return statistics.median(times)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the store sampled")
    p.add_argument("--build-rows", type=int, default=10_000_000, help="leaves of the tree whose build is timed")
    p.add_argument("--calls", type=int, default=2000, help="calls of each sampler (the first 200: cold)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.build_rows, args.calls = 20_000, 200_000, 400
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / "per"
        build_store(path, args.rows)
        rows, opened = bench_sampling(path, args.calls)
    build = bench_build(args.build_rows, 5)
    lines = ["| measurement | PrioritizedSampler ms | uniform buffer.sample ms | ratio |", "|---|---|---|---|"]
    for what, ours, uni in rows:
        lines.append(f"| {what} | {ours * 1e3:.3f} | {uni * 1e3:.3f} | {ours / uni:.2f}x |")
    lines.append(f"| tree build, {args.build_rows:,} rows | {build * 1e3:.0f} | - | - |")
    lines.append(f"| PrioritizedSampler open, {args.rows:,} rows (priorities read from the store) | {opened * 1e3:.0f} "
                 "| - | - |")
    body = (f"{args.rows:,} rows of (17,) f32 transitions (raw chunks, page cache warm), every row with a random "
            f"priority (alpha 0.6); calls timed in blocks of {BLOCK} consecutive calls. Cold: the mean of the first "
            f"{COLD} calls after opening, each system on a buffer opened for it alone, three rounds taking turns. "
            f"Steady: {args.calls:,} calls of each on one buffer, blocks interleaved and the order rotated each "
            f"round, the calls after the first {COLD}. Target: `sample(256)` within 2x of uniform.\n\n"
            + "\n".join(lines) + "\n\n"
            "Beyond uniform's draw and gather, a prioritized `sample(256)` searches the sum tree (a `searchsorted` "
            "over its top row, then one 16-ary descent step per level below it), computes the importance weights "
            "and reads the rows through `buffer[indices]`. The training-step row adds `update_priorities(256)`.")
    return section(HEADING[3:], "bench_prioritized.py", argv,
                   runs="cold: median of 3 rounds; steady: mean per call over the calls after the first "
                        f"{COLD} of one run; tree build: median of 5 builds; open: one open.",
                   body=body, quick=args.quick, started=started)


if __name__ == "__main__":
    print(main())
