"""Sequence sampling benchmark: windows from TrajectoryReplayBuffer stores of 1e5 and 1e7 steps
((17,) float32 obs and (6,) float32 action, episodes of 250-750 steps); the cost must not grow
with the store.

Workloads, 256 windows per call:

- ``sample_sequences(256, 32)``, with ``within_episode`` False and True, against a numpy gather
  of the same windows from arrays in RAM (the same sizes);
- per-field windows (issue 16): ``get_sequences(anchors, offsets={"obs": [-1, 0],
  "action": range(16)})`` at random anchors, and ``sample_sequences(256, offsets=...,
  within_episode=True)``.

How it is measured (docs/benchmarks.md): every store is opened afresh for each workload and
round (page cache warm, no read pass before timing: a training loop does none); the stores' calls
run in blocks of 25 consecutive calls, the order rotated each block; "cold" is the mean of the
first 200 calls after opening, "steady" of the calls after those, each the median over 5 rounds.  The target is the ratio of the large
store to the small one (<= 1.3).

    python scripts/bench_trajectory.py                         # 1e5 and 1e7 rows (about 3 minutes)
    python scripts/bench_trajectory.py --quick                 # 1e4 and 1e5 rows (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import BLOCK, COLD, run_blocks  # noqa: E402
from benchdoc import cold_steady_note, section  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402

B, T = 256, 32
#: Diffusion-Policy-style per-field windows: two observation frames, sixteen actions.
FIELDS = {"obs": [-1, 0], "action": list(range(16))}
Call = Callable[[], Any]


def build(path: Path, rows: int, mean_episode: int = 500) -> None:
    """A store of ``rows`` steps ({"obs": (17,), "action": (6,)} float32) in episodes of random length."""
    rng = np.random.default_rng(0)
    space = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (17,), np.float32),
                             "action": gym.spaces.Box(-1, 1, (6,), np.float32)})
    tb = TrajectoryReplayBuffer.create(space, cache_path=path, overwrite=True)
    lengths = rng.integers(mean_episode // 2, mean_episode * 3 // 2, size=rows // mean_episode * 2 + 2)
    ids = np.searchsorted(np.cumsum(lengths), np.arange(rows), side="right").astype(np.int64)
    block = 1 << 18
    for lo in range(0, rows, block):
        hi = min(lo + block, rows)
        step = {"obs": rng.standard_normal((hi - lo, 17)).astype(np.float32),
                "action": rng.uniform(-1, 1, (hi - lo, 6)).astype(np.float32)}
        tb.extend({"step_data": step, "episode_ids": ids[lo:hi]})
    tb.close()
    os.sync()  # write back now, not while a store is measured


def numpy_gather(rows: int) -> Call:
    """The windows of ``sample_sequences(256, 32)`` gathered from in-RAM numpy arrays, mask included."""
    rng = np.random.default_rng(2)
    obs = rng.standard_normal((rows, 17)).astype(np.float32)
    ids = np.repeat(np.arange(rows // 500 + 1), 500)[:rows]
    offs = np.arange(T)

    def gather() -> Any:
        a = rng.integers(0, rows, B)
        r = np.minimum(a[:, None] + offs, rows - 1)
        return obs[r], ids[r] == ids[a][:, None]

    return gather


WORKLOADS: dict[str, Callable[[TrajectoryReplayBuffer, np.random.Generator], Any]] = {
    "sample_sequences(256, 32)": lambda tb, g: tb.sample_sequences(B, T, rng=g),
    "sample_sequences(256, 32, within_episode=True)": lambda tb, g: tb.sample_sequences(B, T, rng=g,
                                                                                        within_episode=True),
    "get_sequences(256 anchors, offsets=obs [-1,0] + action 0..15)": lambda tb, g: tb.get_sequences(
        g.integers(0, len(tb), B), offsets=FIELDS),
    "sample_sequences(256, offsets=obs [-1,0] + action 0..15, within_episode=True)": lambda tb, g: tb.sample_sequences(
        B, offsets=FIELDS, rng=g, within_episode=True),
}


def measure(paths: dict[int, Path], calls: int, rounds: int) -> list[dict[str, Any]]:
    """Every workload on every store, ``rounds`` times: each round opens the stores afresh and
    runs blocks rotated between them (the numpy gather of the first workload's windows runs with
    them).  Cold and steady are the medians over rounds; ``cold_rounds`` keeps each round's."""
    rows_out: list[dict[str, Any]] = []
    for k, (what, fn) in enumerate(WORKLOADS.items()):
        per: dict[str, list[np.ndarray]] = {}
        for r in range(rounds):
            opened = {n: TrajectoryReplayBuffer.load_from(p, read_only=True) for n, p in paths.items()}
            g = np.random.default_rng(1 + r)
            systems: dict[str, Call] = {str(n): (lambda tb=tb: fn(tb, g)) for n, tb in opened.items()}
            if k == 0:
                systems.update({f"numpy {n}": numpy_gather(n) for n in paths})
            if r % 2:  # which store opens first and runs the first block alternates between rounds
                systems = dict(reversed(list(systems.items())))
            for name, t in run_blocks(systems, calls).items():
                per.setdefault(name, []).append(t)
            for tb in opened.values():
                tb.close()
        for name, ts in per.items():
            cold = [t[:COLD].mean() * 1e3 for t in ts]
            rows_out.append({"what": what if name.isdigit() else "numpy in-RAM gather of the same windows",
                             "rows": int(name.split()[-1]), "cold": float(np.median(cold)), "cold_rounds": cold,
                             "steady": float(np.median([t[COLD:].mean() * 1e3 for t in ts]))})
    return rows_out


def table(results: list[dict[str, Any]], small: int, large: int) -> str:
    lines = ["| workload | store rows | cold ms/call | steady ms/call |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['what']} | {r['rows']:,} | {r['cold']:.3f} | {r['steady']:.3f} |")
    lines += ["", f"Ratio {large:,} rows / {small:,} rows (target <= 1.3); cold: the ratio of the medians, then "
              "each round's own ratio:", "",
              "| workload | cold | cold, each round | steady |", "|---|---|---|---|"]
    by = {(r["what"], r["rows"]): r for r in results}
    for what in dict.fromkeys(r["what"] for r in results):
        hi, lo = by[(what, large)], by[(what, small)]
        each = ", ".join(f"{a / b:.2f}" for a, b in zip(hi["cold_rounds"], lo["cold_rounds"]))
        lines.append(f"| {what} | {hi['cold'] / lo['cold']:.2f} | {each} | {hi['steady'] / lo['steady']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=None, help="fresh opens per workload (default 5; --quick 2)")
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    small, large = (10_000, 100_000) if args.quick else (100_000, 10_000_000)
    calls = COLD + (50 if args.quick else 400)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        paths = {n: Path(d) / f"t{n}" for n in (small, large)}
        for n, path in paths.items():
            build(path, n)
        results = measure(paths, calls, rounds)
    body = (f"Windows of {B} anchors from read-only `TrajectoryReplayBuffer` stores of {small:,} and {large:,} steps "
            "({\"obs\": (17,), \"action\": (6,)} float32, episodes of 250-750 steps), each store opened afresh per "
            "workload and round, the opening order alternating; " + cold_steady_note(BLOCK, COLD) + " Per-field "
            "windows read obs at offsets -1, 0 and action at 0..15 (Diffusion Policy's 2 observation frames and 16 "
            f"actions). The numpy gather takes `sample_sequences({B}, {T})`'s windows from arrays in RAM: its own "
            "growth between sizes is what the memory hierarchy costs. The large store's cold calls also pay what a "
            "fresh open costs once in proportion to its size (mapping every chunk file, faulting its pages in; "
            "performance-notes.md).\n\n" + table(results, small, large))
    return section("Sequence sampling (scripts/bench_trajectory.py)", "bench_trajectory.py", argv,
                   runs=f"every cold and steady figure is the median of {rounds} rounds (fresh opens).",
                   body=body, quick=args.quick, started=started)


if __name__ == "__main__":
    print(main())
