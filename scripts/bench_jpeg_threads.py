"""JPEG frames on 1 and 2 decode threads, per decoding library, side by side in one process (issue 31).

A store of 84x84x3 jpeg:90 frames per source (bench_codecs' photos and gymnasium renders); reads
are ``sample(256)`` in blocks of ``--calls`` consecutive calls, one block per mode and window, the
modes' order rotated from one window to the next, no warm-up: imagecodecs and simplejpeg
(``trajstore.images.set_jpeg_decoder``) on 1 and 2 threads (``set_decode_threads``), and a control:
two processes reading at once, each on 1 thread with the default library, which is what 2 cores
give a load that shares nothing (the machine's ceiling for "2 threads vs 1" at that moment).
Printed per source: medians over the windows of each ratio (taken within a window), and the same
over the windows where the control got >= 1.85x (both cores were free then).

    python scripts/bench_jpeg_threads.py                       # 20,000 frames, 20 windows of 5 calls
    python scripts/bench_jpeg_threads.py --frames 2000 --windows 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_codecs as bc

import trajstore.images as ti
from trajstore import ReplayBuffer

LIBS = ("imagecodecs", "simplejpeg")


def measure(path: Path, windows: int, calls: int) -> dict[tuple[str, int], list[float]]:
    """Frames/s of each mode ``(library, threads)`` (threads 0: the 2-process control), per window."""
    ro = ReplayBuffer.load_from(str(path), read_only=True)
    g = np.random.default_rng(0)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the control's second process: a block of calls whenever asked
        ti.set_jpeg_decoder(None)
        ti.set_decode_threads(1)
        while os.read(go_r, 1) == b"g":
            for _ in range(calls):
                ro.sample(bc.BATCH, rng=g)
            os.write(done_w, b"k")
        os._exit(0)
    modes = [(lib, n) for lib in LIBS for n in (1, 2)] + [("default", 0)]
    fps: dict[tuple[str, int], list[float]] = {m: [] for m in modes}
    try:
        for w in range(windows):
            for lib, n in modes[w % len(modes):] + modes[: w % len(modes)]:
                ti.set_jpeg_decoder(None if lib == "default" else lib)
                ti.set_decode_threads(max(n, 1))
                t0 = time.perf_counter()
                if n == 0:
                    os.write(go_w, b"g")
                for _ in range(calls):
                    ro.sample(bc.BATCH, rng=g)
                if n == 0:
                    os.read(done_r, 1)
                fps[(lib, n)].append(bc.BATCH * calls * (2 if n == 0 else 1) / (time.perf_counter() - t0))
    finally:
        os.write(go_w, b"q")
        os.waitpid(pid, 0)
        ti.set_jpeg_decoder(None)
        ti.set_decode_threads(None)
        ro.close()
    return fps


def report(label: str, fps: dict[tuple[str, int], list[float]]) -> str:
    """Median ratios within windows: 2 threads vs 1 per library, simplejpeg vs imagecodecs, control."""
    one = fps[("simplejpeg", 1)]
    control = [c / o for c, o in zip(fps[("default", 0)], one)]
    lines = []
    for name, idx in (("all windows", range(len(one))),
                      ("control >= 1.85x", [i for i, c in enumerate(control) if c >= 1.85])):
        idx = list(idx)
        if not idx:
            lines.append(f"  {name}: none")
            continue

        def med(a: tuple[str, int], b: tuple[str, int]) -> float:
            return statistics.median(fps[a][i] / fps[b][i] for i in idx)

        lines.append(
            f"  {name} ({len(idx)}): 2 vs 1 thread: imagecodecs {med(('imagecodecs', 2), ('imagecodecs', 1)):.2f}, "
            f"simplejpeg {med(('simplejpeg', 2), ('simplejpeg', 1)):.2f}; simplejpeg / imagecodecs: 1 thread "
            f"{med(('simplejpeg', 1), ('imagecodecs', 1)):.2f}, 2 threads {med(('simplejpeg', 2), ('imagecodecs', 2)):.2f}; "
            f"control {statistics.median(control[i] for i in idx):.2f}; frames/s "
            + ", ".join(f"{lib} {n or '2 proc'}: {statistics.median(fps[(lib, n)][i] for i in idx):,.0f}"
                        for lib, n in fps))
    return f"{label}:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Build the stores, measure, print the ratios with the load average."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=20_000, help="frames per store")
    ap.add_argument("--windows", type=int, default=20, help="windows (each: one block per mode)")
    ap.add_argument("--calls", type=int, default=5, help="sample(256) calls per block")
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default a temp folder)")
    a = ap.parse_args(argv)
    pool, _ = bc.photos()
    sources = [("photos", bc.crops(pool, min(a.frames, 2000), (84, 84, 3))),
               ("renders", bc.renders(min(a.frames, 2000), (84, 84, 3))[0])]
    with tempfile.TemporaryDirectory(prefix="bench_jpeg_threads_", dir=a.dir) as d:
        for label, frames in sources:
            if frames is None:
                print(f"{label}: not measured (no renderer)")
                continue
            path = Path(d) / label
            bc.build(path, frames, a.frames, "jpeg:90")
            load0 = os.getloadavg()[0]
            fps = measure(path, a.windows, a.calls)
            print(f"{report(label, fps)}\n  ({time.strftime('%H:%M')}, {a.windows} windows x {len(fps)} blocks of "
                  f"{a.calls} calls, load average {load0:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
