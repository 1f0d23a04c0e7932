"""How fast ``trajstore view`` answers (issue 34): a benchmark, not a test.

- the overview of a 1e7-row replay store (CartPole-like rows, episodes of 200 steps): the first
  ``/api/overview`` and the first page of the episode table sorted by return, each on a fresh
  server (nothing cached), target <= 300 ms;
- an episode page of 1,000 steps with 2 image fields (96x96 JPEG and 64x64 PNG frames): from the
  ``/api/episode`` request to both first frames loaded, on a fresh server, target <= 1 s;
- thumbnails per second: 64-pixel JPEG thumbnails of random steps, one connection, and 4 at once,
  target >= 100/s.

Usage::

    python scripts/bench_view.py [--quick] [--dir DIR] [--markdown FILE]

``--quick``: 1e5 rows and 200 steps (for tests of the script).  :func:`main` returns the markdown
section; ``--markdown FILE`` also writes it there.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
from gymnasium.spaces import Box, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajstore import ReplayBuffer, TrajectoryReplayBuffer  # noqa: E402
from trajstore.cli.view import open_view  # noqa: E402


def _replay_store(path: str, rows: int, ep_len: int = 200) -> str:
    space = Dict({"obs": Box(-5, 5, (4,), np.float32), "action": Box(0, 1, (), np.int64),
                  "reward": Box(0, 1, (), np.float32), "terminated": Box(0, 1, (), np.bool_),
                  "truncated": Box(0, 1, (), np.bool_)})
    block = 1 << 18
    rng = np.random.default_rng(0)
    with ReplayBuffer.create(space, cache_path=path) as rb:
        for lo in range(0, rows, block):
            n = min(block, rows - lo)
            idx = np.arange(lo, lo + n)
            rb.extend({"obs": rng.standard_normal((n, 4), np.float32), "action": idx % 2,
                       "reward": np.ones(n, np.float32), "terminated": (idx % ep_len) == ep_len - 1,
                       "truncated": np.zeros(n, bool)})
    return path


def _image_store(path: str, steps: int) -> str:
    space = Dict({"cam": Box(0, 255, (96, 96, 3), np.uint8), "wrist": Box(0, 255, (64, 64, 3), np.uint8),
                  "action": Box(-1, 1, (7,), np.float32), "reward": Box(0, 1, (), np.float32)})
    buf = TrajectoryReplayBuffer.create(space, cache_path=path, compressor={"cam": "jpeg:90", "wrist": "png"})
    rng = np.random.default_rng(1)
    for lo in range(0, steps, 250):
        n = min(250, steps - lo)
        grad = np.linspace(0, 255, 96, dtype=np.float32)
        cam = (grad[None, :, None, None] + grad[None, None, :, None] * 0 + rng.integers(0, 30, (n, 1, 1, 3))).clip(0, 255)
        buf.extend({"cam": np.broadcast_to(cam, (n, 96, 96, 3)).astype(np.uint8),
                    "wrist": rng.integers(0, 255, (n, 64, 64, 3), np.uint8),
                    "action": rng.uniform(-1, 1, (n, 7)).astype(np.float32), "reward": np.ones(n, np.float32)})
    buf.mark_episode_end()
    buf.close()
    return path


class _Served:
    """A fresh server for ``path`` in a thread, and GETs on keep-alive connections."""

    def __init__(self, path: str) -> None:
        self.server = open_view(path)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.local = threading.local()

    def get(self, target: str) -> bytes:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            host, port = self.server.server_address[:2]
            conn = self.local.conn = http.client.HTTPConnection(str(host), int(port), timeout=120)
        conn.request("GET", target)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET {target}: {r.status} {body[:200]!r}")
        return body

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _timed(path: str, targets: list[str]) -> float:
    """Seconds to answer ``targets`` in turn on a fresh server."""
    s = _Served(path)
    try:
        t = time.perf_counter()
        for target in targets:
            s.get(target)
        return time.perf_counter() - t
    finally:
        s.close()


def _first_frames(path: str) -> float:
    s = _Served(path)
    try:
        t = time.perf_counter()
        s.get("/api/episode?id=0")
        with ThreadPoolExecutor(2) as pool:  # the page asks for both fields' frames at once
            list(pool.map(s.get, [f"/api/frame?id=0&field=step_data/{f}&step=0&fmt=png&size=0" for f in ("cam", "wrist")]))
        return time.perf_counter() - t
    finally:
        s.close()


def _thumbnails(path: str, steps: int, n: int, threads: int) -> float:
    s = _Served(path)
    rng = np.random.default_rng(2)
    targets = [f"/api/frame?id=0&field=step_data/cam&step={k}&fmt=jpeg&size=64" for k in rng.integers(0, steps, n)]
    try:
        s.get(targets[0])
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(s.get, targets))
        return n / (time.perf_counter() - t)
    finally:
        s.close()


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark; returns its markdown section (also printed, and written with --markdown)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1e5 rows and 200 steps")
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temporary one)")
    ap.add_argument("--markdown", default=None, help="also write the section to this file")
    args = ap.parse_args(argv)
    rows, steps = (100_000, 200) if args.quick else (10_000_000, 1000)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t = time.perf_counter()
        replay = _replay_store(os.path.join(tmp, "replay"), rows)
        images = _image_store(os.path.join(tmp, "images"), steps)
        built = time.perf_counter() - t
        overview = min(_timed(replay, ["/api/overview"]) for _ in range(3))
        table = min(_timed(replay, ["/api/episodes?sort=return&desc=1&limit=50"]) for _ in range(3))
        first = min(_first_frames(images) for _ in range(3))
        one = _thumbnails(images, steps, 200 if args.quick else 1000, 1)
        four = _thumbnails(images, steps, 200 if args.quick else 1000, 4)
    rows_md: list[tuple[str, str, str]] = [
        (f"overview of a {rows:,}-row replay store (`/api/overview`, fresh server)", f"{overview * 1e3:.0f} ms", "<= 300 ms"),
        (f"episode table, first page sorted by return ({rows // 200:,} episodes, fresh server)", f"{table * 1e3:.0f} ms",
         "-"),
        (f"episode of {steps:,} steps with 2 image fields: episode + both first frames", f"{first * 1e3:.0f} ms", "<= 1 s"),
        ("64-px JPEG thumbnails of random steps, 1 connection", f"{one:.0f} /s", ">= 100/s"),
        ("64-px JPEG thumbnails of random steps, 4 connections", f"{four:.0f} /s", ">= 100/s"),
    ]
    lines = ["## trajstore view", "",
             f"`python scripts/bench_view.py{' --quick' if args.quick else ''}` (stores built in {built:.0f} s; "
             "each time the best of 3 fresh servers, uncached).", "",
             "| what | measured | target |", "|---|---:|---:|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows_md]
    md = "\n".join(lines) + "\n"
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    return md


if __name__ == "__main__":
    main()
