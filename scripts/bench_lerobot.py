"""LeRobot datasets benchmark: import_lerobot's time and sizes, open_lerobot's windows.

    python scripts/bench_lerobot.py --episodes 50   # issue 32's size: 50 x 300 frames, 2 cameras 480x640 AV1, 14-dim
    python scripts/bench_lerobot.py                 # 10 episodes (what bench_all runs, within its time budget)
    python scripts/bench_lerobot.py --quick         # 6 episodes x 60 frames, 96x128 (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).

The dataset is written per LeRobot v3.0's specification (tests/lerobot_fixture.py: one Parquet
file, one MP4 per camera, libsvtav1 crf 30 g 2 as LeRobot encodes, every episode from a keyframe).
Measured: the import (packets kept: nothing decoded), the time to read every file of the dataset
once (the floor an import cannot beat), bytes before and after; ``open_lerobot``'s windows of
Diffusion Policy's defaults (2 observation frames of both cameras and the state, 16 actions, as
``delta_timestamps``) in frames decoded per second; the same windows over 1e2 and 1e4 episodes
(tiny frames) for flatness.  LeRobot's own loader is not installable here (no side-by-side rate).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from benchdoc import section  # noqa: E402
from lerobot_fixture import write_v3  # noqa: E402

from trajstore.interop import import_lerobot, open_lerobot  # noqa: E402

CAMS = ("observation.images.top", "observation.images.wrist")


def folder_bytes(path: Path, part: str = "") -> int:
    """Bytes on disk (allocated blocks: a store's mapped files are sparse) of the files under ``path``
    whose path contains ``part``."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and part in str(p.relative_to(path)))


def read_once(path: Path) -> float:
    """Seconds to read every file under ``path`` once."""
    t = time.perf_counter()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass
    return time.perf_counter() - t


def copy_once(src: Path, dst: Path) -> float:
    """Seconds to copy the folder ``src`` to ``dst`` (read and write every file once)."""
    t = time.perf_counter()
    shutil.copytree(src, dst)
    return time.perf_counter() - t


def _deltas(fps: int) -> dict[str, list[float]]:
    """Diffusion Policy's defaults: 2 frames of both cameras and the state, 16 actions."""
    return {cam: [-1 / fps, 0.0] for cam in CAMS} | {"observation.state": [-1 / fps, 0.0],
                                                     "action": [i / fps for i in range(16)]}


def window_rates(roots: list[Path], fps: int, batches: int, batch: int, rounds: int) -> list[tuple[float, float]]:
    """Per dataset: (windows/s, frames decoded/s) of ``get_time_windows`` over random sorted
    anchors, the median of ``rounds`` rounds, the datasets taking turns each round (a loaded
    machine's drift falls on all of them alike)."""
    deltas = _deltas(fps)
    bufs = [open_lerobot(r) for r in roots]
    try:
        g = np.random.default_rng(0)
        for lr in bufs:
            lr.get_time_windows(g.integers(0, len(lr), batch), deltas)  # opens the shards' packet index
        times: list[list[float]] = [[] for _ in bufs]
        for _ in range(rounds):
            for i, lr in enumerate(bufs):
                t = time.perf_counter()
                for _ in range(batches):
                    lr.get_time_windows(np.sort(g.integers(0, len(lr), batch)), deltas)
                times[i].append(time.perf_counter() - t)
    finally:
        for lr in bufs:
            lr.close()
    out = []
    for ts in times:
        rate = batches * batch / float(np.median(ts))
        out.append((rate, rate * 2 * len(CAMS)))
    return out


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; return the markdown section."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--episodes", type=int, default=10, help="episodes of 300 frames of the import dataset "
                    "(issue 32 asks for 50; 10 fit bench_all's time budget)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    eps, n, size = (6, 60, (96, 128)) if args.quick else (args.episodes, 300, (480, 640))
    flat = (100, 1000) if args.quick else (100, 10000)
    fps = 30
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "lerobot"
        write_v3(str(src), [n] * eps, CAMS, fps=fps, size=size, dims=(14, 14))
        floor = read_once(src)
        copy = copy_once(src, Path(tmp) / "copy")
        shutil.rmtree(Path(tmp) / "copy")
        t = time.perf_counter()
        out = import_lerobot(src, Path(tmp) / "store")
        dt = time.perf_counter() - t
        before, after = folder_bytes(src), folder_bytes(Path(tmp) / "store")
        v_before, v_after = folder_bytes(src, "videos"), folder_bytes(Path(tmp) / "store", "/video/")
        ((wps, fps_dec),) = window_rates([src], fps, 5 if args.quick else 10, 32, 1 if args.quick else 3)
        rows = [f"| import_lerobot | {dt:.2f} s | {floor:.2f} s | {copy:.2f} s | {before / 1e6:.1f} MB | {after / 1e6:.1f} MB | "
                f"{v_after / max(v_before, 1):.3f} |"]
        flat_rows, dirs, imports = [], [], []
        for count in flat:
            d = Path(tmp) / f"flat{count}"
            write_v3(str(d), [8] * count, CAMS, fps=fps, size=(32, 32))
            t = time.perf_counter()
            import_lerobot(d, Path(tmp) / f"flat{count}.store")
            imports.append(time.perf_counter() - t)
            dirs.append(d)
        rates = window_rates(dirs, fps, 10, 32, 3 if args.quick else 7)
        for count, (w, f), it in zip(flat, rates, imports):
            flat_rows.append(f"| {count} | {w:.0f} | {f:.0f} | {it:.2f} s |")
    body = f"""A LeRobot v3.0 dataset of {eps} episodes x {n} frames, 2 cameras {size[0]}x{size[1]} AV1 (crf 30,
g 2, as LeRobot encodes) and 14-dim state and action, imported with the cameras' packets kept
(adopted per camera: {out['adopted']}; transcoded: {out['transcoded']}), against reading every file
of the dataset once and copying the folder (the files were just written: they are in the page
cache). Bytes are allocated blocks on disk. Video ratio: the store's video segments' bytes over the
MP4s' bytes. The import commits per batch of episodes and verifies the store before renaming it.

| what | time | read files once | copy files once | bytes before | bytes after | video after / before |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

`open_lerobot` windows (Diffusion Policy's defaults as `delta_timestamps`: 2 frames of both cameras
and the state, 16 actions; batches of 32 sorted random anchors; median of 3 rounds): {wps:.1f} windows/s, {fps_dec:.0f} frames
decoded/s. LeRobot's own `LeRobotDataset` is not installable here, so there is no side-by-side rate.

Flatness: the same windows over datasets of 8-frame episodes, 32x32 frames (median of rounds in
which the datasets take turns), and their import:

| episodes | windows/s | frames/s | import |
|---|---|---|---|
{chr(10).join(flat_rows)}
"""
    return section("LeRobot datasets (scripts/bench_lerobot.py)", "bench_lerobot.py", argv or [],
                   runs="one run per number (import once; windows over the stated batches)", body=body,
                   quick=args.quick, started=started, packages=("av", "pyarrow"), store_dir=Path(tempfile.gettempdir()))


if __name__ == "__main__":
    print(main(sys.argv[1:]))
    os._exit(0)
