"""Video fields: episode windows and random frames from H.264 / AV1 video, next to a per-frame JPEG
store and raw frames (issue 31 point 3).

Frames: a camera panning and zooming over a photo (matplotlib's grace_hopper.jpg), a different
path per episode, at 480x640x3 (``--quick``: 120x160).  Four stores of the same episodes, each a
``TrajectoryReplayBuffer`` whose ``obs`` field is raw, ``jpeg:90`` (one encoded frame per row),
``h264`` (crf 23, keyframe every 10 frames) or ``lerobot`` (AV1, crf 30, keyframe every 2 frames).

Workloads, each store freshly opened read-only in this process, page cache warm:

- ``get_sequences`` of 64-frame windows inside episodes (4 windows a call): frames/s;
- a random single frame (``rb[i]``): milliseconds per frame;
- bytes on disk of the field (the files' allocated blocks).

How it is measured: the stores run in blocks of consecutive calls (:func:`bench_core.run_blocks`),
the order of the stores rotated each round, no warm-up call: "cold" is the first block after
opening, "steady" the calls after it.  The whole measurement is repeated ``--runs`` times (fresh
opens each time) and the table gives the median over the runs.

    python scripts/bench_video.py            # 480x640, 4 episodes of 150 frames (about 2 minutes on 2 cores)
    python scripts/bench_video.py --quick    # 120x160, a few seconds (smoke test)

:func:`main` returns the markdown section (docs/benchmarks.md).
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gymnasium as gym  # noqa: E402
from bench_core import run_blocks  # noqa: E402
from benchdoc import section  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402

HEADING = "## Video (scripts/bench_video.py)"
WINDOW, ANCHORS = 64, 4
STORES = {"raw": None, "jpeg:90": "jpeg:90", "h264": "h264:crf=23:g=10", "av1 (lerobot)": "lerobot"}


def camera_frames(n: int, shape: tuple[int, int, int], seed: int) -> np.ndarray:
    """``n`` frames of a camera panning and slowly zooming across a photo along a seeded path."""
    import matplotlib
    from PIL import Image

    photo = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    rng = np.random.default_rng(seed)
    w0, h0 = photo.size
    (x0, y0), (x1, y1) = rng.uniform(0, 1, 2), rng.uniform(0, 1, 2)
    s0, s1 = rng.uniform(0.5, 0.9, 2)
    out = np.empty((n, *shape), np.uint8)
    for i in range(n):
        t = i / max(n - 1, 1)
        s = s0 + (s1 - s0) * t
        w, h = int(w0 * s), int(h0 * s)
        x, y = int((x0 + (x1 - x0) * t) * (w0 - w)), int((y0 + (y1 - y0) * t) * (h0 - h))
        out[i] = np.asarray(photo.crop((x, y, x + w, y + h)).resize((shape[1], shape[0]), Image.BILINEAR))
    return out


def build(root: Path, episodes: list[np.ndarray], compressor: str | None) -> Path:
    space = gym.spaces.Dict({"obs": gym.spaces.Box(0, 255, episodes[0].shape[1:], np.uint8)})
    path = root / (compressor or "raw").replace(":", "_")
    with TrajectoryReplayBuffer.create(space, cache_path=str(path), compressor={"obs": compressor} if compressor
                                       else None) as tb:
        for ep in episodes:
            tb.extend({"obs": ep})
            tb.mark_episode_end()
    return path


def disk_bytes(path: Path) -> int:
    """Allocated bytes of the ``obs`` field's files (``du``)."""
    return sum(os.stat(Path(d) / f).st_blocks * 512 for d, _, fs in os.walk(path / "step_data" / "obs") for f in fs)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def measure(paths: dict[str, Path], lengths: list[int], calls: int, block: int, seed: int) -> dict[str, dict[str, float]]:
    """One run: fresh read-only opens; windows (frames/s) and single frames (ms), cold and steady."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    g = np.random.default_rng(seed)
    ep = g.integers(0, len(lengths), (calls, ANCHORS))
    anchors = starts[ep] + (g.random((calls, ANCHORS)) * (np.asarray(lengths)[ep] - WINDOW + 1)).astype(np.int64)
    singles = g.integers(0, sum(lengths), calls)
    offsets = list(range(WINDOW))
    bufs = {name: TrajectoryReplayBuffer.load_from(str(p), read_only=True) for name, p in paths.items()}
    try:
        def windows(buf: Any) -> Callable[[], Any]:
            it = iter(range(10**9))
            return lambda: buf.get_sequences(anchors[next(it) % calls], offsets)

        def single(buf: Any) -> Callable[[], Any]:
            it = iter(range(10**9))
            return lambda: buf[int(singles[next(it) % calls])]

        out: dict[str, dict[str, float]] = {name: {} for name in bufs}
        for what, make, per in (("win", windows, ANCHORS * WINDOW), ("one", single, 1)):
            times = run_blocks({n: make(b) for n, b in bufs.items()}, calls, block=block)
            for name, ts in times.items():
                for phase, sl in (("cold", slice(0, block)), ("steady", slice(block, None))):
                    secs = float(ts[sl].sum())
                    n = len(ts[sl])
                    out[name][f"{what}_{phase}"] = n * per / secs if what == "win" else secs / n * 1e3
        return out
    finally:
        for b in bufs.values():
            b.close()


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="120x160 frames, 2 episodes of 80, 1 run (smoke test)")
    ap.add_argument("--episodes", type=int, default=None, help="episodes (default 4; quick 2)")
    ap.add_argument("--length", type=int, default=None, help="frames per episode (default 150; quick 80)")
    ap.add_argument("--calls", type=int, default=None, help="timed calls per store and workload (default 24; quick 4)")
    ap.add_argument("--runs", type=int, default=None, help="repeats, median reported (default 3; quick 1)")
    ap.add_argument("--stores", default=",".join(STORES), help=f"comma-separated, of {list(STORES)}")
    a = ap.parse_args(argv)
    q = a.quick
    shape = (120, 160, 3) if q else (480, 640, 3)
    n_ep, length = a.episodes or (2 if q else 4), a.length or (80 if q else 150)
    calls, runs = a.calls or (4 if q else 24), a.runs or (1 if q else 3)
    block = max(1, min(8, calls // 3))
    if length < WINDOW:
        ap.error(f"--length must be at least the window ({WINDOW})")
    names = [s for s in a.stores.split(",") if s]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    episodes = [camera_frames(length, shape, seed=e) for e in range(n_ep)]
    allf = np.concatenate(episodes)
    with tempfile.TemporaryDirectory(prefix="bench_video_") as d:
        paths, size, quality, build_s = {}, {}, {}, {}
        for name in names:
            t = time.perf_counter()
            paths[name] = build(Path(d), episodes, STORES[name])
            build_s[name] = time.perf_counter() - t
            size[name] = disk_bytes(paths[name])
            with TrajectoryReplayBuffer.load_from(str(paths[name]), read_only=True) as ro:
                quality[name] = _psnr(ro[: len(allf)]["step_data"]["obs"], allf)
        results = [measure(paths, [length] * n_ep, calls, block, seed=r) for r in range(runs)]
    med = {n: {k: statistics.median(r[n][k] for r in results) for k in results[0][n]} for n in names}
    raw = size.get("raw") or len(allf) * int(np.prod(shape))
    lines = ["| obs stored as | window frames/s cold | steady | single frame ms cold | steady | bytes on disk | "
             "vs raw | PSNR dB | write s |", "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        m = med[n]
        lines.append(f"| {n} | {m['win_cold']:,.0f} | {m['win_steady']:,.0f} | {m['one_cold']:.2f} | "
                     f"{m['one_steady']:.2f} | {size[n]:,} | {raw / max(size[n], 1):.1f}x | "
                     f"{'exact' if quality[n] == float('inf') else format(quality[n], '.1f')} | {build_s[n]:.1f} |")
    import av

    ffmpeg = av.ffmpeg_version_info
    body = (f"{n_ep} episodes of {length} frames of {shape[0]}x{shape[1]}x3 (a camera panning over a "
            f"photo); windows: `get_sequences` of {ANCHORS} anchors x {WINDOW} consecutive frames inside episodes; "
            f"single frames: `rb[i]` at random rows (a video frame decodes from the keyframe before it: on average "
            f"(g+1)/2 frames, 5.5 for h264 g 10, 1.5 for AV1 g 2).  Blocks of {block} consecutive calls per store, the stores' "
            f"order rotated each round, no warm-up call; \"cold\" is the first block after opening, \"steady\" the "
            f"other {calls - block} calls.  PyAV {av.__version__} "
            f"(FFmpeg {'.'.join(map(str, ffmpeg)) if isinstance(ffmpeg, tuple) else ffmpeg}), "
            f"h264 = libx264 crf 23 g 10 veryfast, av1 (lerobot) = libsvtav1 crf 30 g 2 (decoded by libdav1d); "
            f"load average {load0:.1f} at the start and {os.getloadavg()[0]:.1f} at the end.\n\n" + "\n".join(lines) + "\n")
    return section(HEADING[3:], "bench_video.py", sys.argv[1:] if argv is None else argv, runs=f"median over {runs} run(s) of fresh opens.",
                   body=body, quick=q, started=t0, packages=("av",))


if __name__ == "__main__":
    print(main())
