"""Image rows: every read path of trajstore against the numpy memmap gather of the same rows (the
limit), and the SB3 buffers against SB3's in-RAM ones, as ratios measured side by side in one run.

Workloads, (84,84,4) uint8 frames (Atari-style), page cache warm, each system freshly opened:

- ``sample(256)``, ``rb[idx]``, a ``get_slice`` view and a ``get_column`` view indexed with 256
  random rows, numpy and torch backends;
- frame stacks: ``get_sequences(idx, offsets=[-3..0])`` and ``sample_sequences(256, 4)`` of a
  ``TrajectoryReplayBuffer`` against the memmap gather of the same 256 x 4 rows;
- ``ZarrReplayBuffer.sample(256)`` (obs and next_obs) and ``add`` against SB3's ``ReplayBuffer``.

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).
How it is measured: each read workload runs in a fresh interpreter that opens
both systems; they run in blocks of 25 consecutive calls, block after block, the order of the
systems rotated each round so neither gets the process's warm-up (allocator, page tables) for free;
no read pass before timing.  "cold" is the total time of the
first 200 calls after opening (the process's mappings cold), "steady" the total of the calls after
those.  Ratio = trajstore / baseline (lower is better).

    python scripts/bench_images.py                 # 50,000 frames (about 3 minutes on 2 cores)
    python scripts/bench_images.py --quick         # 3,000 frames (smoke test)
    python scripts/bench_images.py --sb3-only --sb3-sizes 100000   # only the ZarrReplayBuffer rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gymnasium as gym
from bench_core import BLOCK, COLD, run_blocks
from benchdoc import cold_steady_note, section

from trajstore import ReplayBuffer, TrajectoryReplayBuffer

FRAME = (84, 84, 4)
BATCH = 256
#: reopen-and-add rounds of the ``add`` workload (its rows are the medians over them)
ADD_ROUNDS = 5
Row = dict[str, Any]


def ratio_rows(what: str, times: dict[str, np.ndarray], ours: str, base: str, target: float) -> list[Row]:
    a, b = times[ours], times[base]
    return [{"what": what, "phase": phase, "ours": a[sl].sum() / n * 1e3, "base": b[sl].sum() / n * 1e3,
             "ours_name": ours, "base_name": base, "ratio": a[sl].sum() / b[sl].sum(), "target": target}
            for phase, sl, n in (("cold", slice(0, COLD), COLD), ("steady", slice(COLD, None), len(a) - COLD))]


def _frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` distinct-looking frames, cheap to make (a few base frames rolled)."""
    base = np.random.default_rng(seed).integers(0, 256, size=(16, *FRAME), dtype=np.uint8)
    return np.stack([np.roll(base[i % 16], i, axis=0) for i in range(n)])


def build_stores(tmp: Path, n: int) -> dict[str, Path]:
    """A Dict ReplayBuffer ({"obs": frame, "act": Discrete(4)}), a TrajectoryReplayBuffer of
    1000-step episodes and a memmap file of the same frames."""
    space = gym.spaces.Dict({"obs": gym.spaces.Box(0, 255, FRAME, np.uint8), "act": gym.spaces.Discrete(4)})
    mm = np.lib.format.open_memmap(tmp / "frames.npy", mode="w+", dtype=np.uint8, shape=(n, *FRAME))
    rb = ReplayBuffer.create(space, cache_path=tmp / "rb")
    tb = TrajectoryReplayBuffer.create(gym.spaces.Box(0, 255, FRAME, np.uint8), cache_path=tmp / "tb")
    for lo in range(0, n, 1000):
        frames = _frames(min(1000, n - lo), seed=lo)
        mm[lo : lo + len(frames)] = frames
        rb.extend({"obs": frames, "act": np.arange(len(frames)) % 4})
        tb.extend({"step_data": frames, "episode_ids": np.full(len(frames), lo // 1000)})
    mm.flush()
    del mm
    rb.close()
    tb.close()
    return {"rb": tmp / "rb", "tb": tmp / "tb", "mm": tmp / "frames.npy"}


def _read_workloads(paths: dict[str, Path], n: int) -> dict[str, tuple[str, str, float, Callable[[], dict[str, Callable[[], Any]]]]]:
    """name -> (ours, baseline, target, a function opening both systems and returning their calls)."""
    g = np.random.default_rng(1)
    offs = np.arange(-3, 1)

    def memmap() -> Callable[[], Any]:
        mm = np.load(paths["mm"], mmap_mode="r")
        return lambda: mm[g.integers(0, n, BATCH)]

    def mm_windows() -> Callable[[], Any]:
        mm = np.load(paths["mm"], mmap_mode="r")
        return lambda: mm[(g.integers(3, n, BATCH)[:, None] + offs).ravel()].reshape(BATCH, 4, *FRAME)

    def rb(backend: str = "numpy") -> ReplayBuffer:
        return ReplayBuffer.load_from(paths["rb"], read_only=True, backend=backend)

    def tb() -> TrajectoryReplayBuffer:
        return TrajectoryReplayBuffer.load_from(paths["tb"], read_only=True)

    def indexed(view: Any) -> Callable[[], Any]:
        return lambda: view[g.integers(0, n, BATCH)]

    def sampled(buf: Any) -> Callable[[], Any]:
        return lambda: buf.sample(BATCH)

    def windows(buf: TrajectoryReplayBuffer) -> Callable[[], Any]:
        return lambda: buf.get_sequences(g.integers(0, n, BATCH), offs)

    def sequences(buf: TrajectoryReplayBuffer) -> Callable[[], Any]:
        return lambda: buf.sample_sequences(BATCH, 4)

    return {
        "sample(256), numpy": ("trajstore", "memmap", 1.5, lambda: {"trajstore": sampled(rb()), "memmap": memmap()}),
        "sample(256), torch vs numpy backend": (
            "torch", "numpy", 1.2, lambda: {"torch": sampled(rb("torch")), "numpy": sampled(rb())}),
        "rb[idx], 256 random rows": ("trajstore", "memmap", 1.5, lambda: {"trajstore": indexed(rb()), "memmap": memmap()}),
        "get_slice(:)[idx], 256 random rows": (
            "trajstore", "memmap", 1.5, lambda: {"trajstore": indexed(rb().get_slice(slice(None))), "memmap": memmap()}),
        "get_column(['obs'])[idx], 256 random rows": (
            "trajstore", "memmap", 1.5, lambda: {"trajstore": indexed(rb().get_column(["obs"])), "memmap": memmap()}),
        "get_sequences(256 anchors, offsets -3..0)": (
            "trajstore", "memmap", 1.5,
            lambda: {"trajstore": windows(tb()), "memmap": mm_windows()}),
        "sample_sequences(256, 4)": (
            "trajstore", "memmap", 1.5,
            lambda: {"trajstore": sequences(tb()), "memmap": mm_windows()}),
    }


def bench_read(paths: dict[str, Path], n: int, calls: int, name: str) -> list[Row]:
    """One read workload, both systems freshly opened in this process."""
    ours, base, target, make = _read_workloads(paths, n)[name]
    return ratio_rows(name, run_blocks(make(), calls), ours, base, target)


def bench_reads(tmp: Path, paths: dict[str, Path], n: int, calls: int) -> list[Row]:
    """Every read workload in a fresh interpreter of its own (cold means cold for both systems:
    no mapping, allocator arena or page table left over from an earlier workload)."""
    rows: list[Row] = []
    for name in _read_workloads(paths, n):
        out = tmp / "rows.json"
        subprocess.run([sys.executable, __file__, "--one", name, "--dir", str(tmp), "--rows", str(n),
                        "--calls", str(calls), "--json", str(out)], check=True)
        rows += json.loads(out.read_text())
    return rows


def _sb3_add(buf: Any, frames: np.ndarray) -> Callable[[], None]:
    """One ``add`` of a (1, 84, 84, 4) frame pair per call, cycling through ``frames``."""
    act, rew, done, infos = np.zeros((1, 1), np.int64), np.zeros(1, np.float32), np.zeros(1, bool), [{}]
    k = [0]

    def go() -> None:
        i = k[0] = (k[0] + 1) % (len(frames) - 1)
        buf.add(frames[i], frames[i + 1], act, rew, done, infos)

    return go


def bench_sb3(tmp: Path, size: int, calls: int, with_add: bool) -> list[Row]:
    """ZarrReplayBuffer vs SB3's ReplayBuffer holding ``size`` transitions: sample(256) (obs and
    next_obs), and (``with_add``) ``add`` once the ring is full."""
    from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer

    from trajstore.sb3 import ZarrReplayBuffer

    obs_space, act_space = gym.spaces.Box(0, 255, FRAME, np.uint8), gym.spaces.Discrete(4)
    frames = _frames(64)[:, None]
    ref = SB3ReplayBuffer(size, obs_space, act_space, "cpu")
    path = tmp / f"sb3_{size}"
    ours = ZarrReplayBuffer(size, obs_space, act_space, "cpu", cache_path=path, overwrite=True)
    fill_ref, fill_ours = _sb3_add(ref, frames), _sb3_add(ours, frames)
    for _ in range(size):
        fill_ref()
        fill_ours()
    ours.close()
    ours = ZarrReplayBuffer(size, obs_space, act_space, "cpu", cache_path=path, resume=True)  # reopened
    try:
        t = run_blocks({"trajstore": lambda: ours.sample(BATCH), "sb3": lambda: ref.sample(BATCH)}, calls)
        rows = ratio_rows(f"ZarrReplayBuffer.sample(256), {size:,} transitions", t, "trajstore", "sb3", 1.0)
        if with_add:
            what = f"ZarrReplayBuffer.add, {size:,} transitions (ring full)"
            per_round = []
            for _ in range(ADD_ROUNDS):  # each round reopens the ring: its first adds are cold again
                ours.close()
                ours = ZarrReplayBuffer(size, obs_space, act_space, "cpu", cache_path=path, resume=True)
                t = run_blocks({"trajstore": _sb3_add(ours, frames), "sb3": _sb3_add(ref, frames)},
                               max(4 * calls, COLD + 400))
                per_round.append(ratio_rows(what, t, "trajstore", "sb3", 1.5))
            rows += [{**phase[0], **{k: float(np.median([r[k] for r in phase])) for k in ("ours", "base", "ratio")}}
                     for phase in zip(*per_round)]
    finally:
        ours.close()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| workload | phase | trajstore ms/call | baseline | baseline ms/call | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "ok" if r["ratio"] <= r["target"] else "MISSED"
        lines.append(f"| {r['what']} | {r['phase']} | {r['ours']:.3f} | {r['base_name']} | {r['base']:.3f} | "
                     f"{r['ratio']:.2f} | <= {r['target']} ({ok}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3,000 frames, fewer calls (a smoke test)")
    ap.add_argument("--rows", type=int, default=None, help="frames in the stores (default 50,000)")
    ap.add_argument("--sb3-sizes", type=str, default=None, help="comma-separated sizes (default 1000,10000,100000)")
    ap.add_argument("--sb3-only", action="store_true", help="only the ZarrReplayBuffer workloads (a quick check: SB3's sample time depends on the process's allocation history, which the read workloads change; see docs/performance-notes.md)")
    ap.add_argument("--calls", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one read workload
    ap.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    n = a.rows or (3000 if a.quick else 50_000)
    calls = a.calls or (250 if a.quick else 600)
    if a.one is not None:  # a child of bench_reads
        paths = {"rb": a.dir / "rb", "tb": a.dir / "tb", "mm": a.dir / "frames.npy"}
        a.json.write_text(json.dumps(bench_read(paths, n, calls, a.one)))
        return ""
    sizes = [int(s) for s in (a.sb3_sizes or ("1000" if a.quick else "1000,10000,100000")).split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_images_") as d:
        tmp = Path(d)
        rows = [] if a.sb3_only else bench_reads(tmp, build_stores(tmp, n), n, calls)
        for size in sizes:
            rows += bench_sb3(tmp, size, calls, with_add=size == sizes[-1])
    body = (f"{n:,} frames of (84,84,4) uint8, {calls} calls per system. Each read workload runs in a fresh "
            "interpreter that opens both systems. " + cold_steady_note(BLOCK, COLD) + " Ratio = trajstore / "
            "baseline time (lower is better). `ZarrReplayBuffer` rows: obs and next_obs against SB3's in-RAM "
            "`ReplayBuffer` (its `sample` returns torch tensors); `add` into a full ring, timed add by add. SB3's "
            "own `sample` swings from run to run with its process's allocation history (performance-notes.md).\n\n"
            + table(rows))
    return section("Image rows: every read path against the memmap limit (scripts/bench_images.py)",
                   "bench_images.py", argv,
                   runs="reads and `sample`: one run per workload (each in a fresh interpreter): cold is the mean "
                        f"of its first {COLD} calls, steady of the others; `add`: the median of {ADD_ROUNDS} rounds, "
                        "each on the ring reopened (cold = its first adds after the reopen).",
                   body=body, quick=a.quick, started=started, packages=("torch", "stable-baselines3"))


if __name__ == "__main__":
    print(main())
