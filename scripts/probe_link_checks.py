"""Per-read cost of the linked-segment change check (trajstore.storage.fields.video_pack): each
GOP read of a linked segment compares the pack's ``fstat`` with the one of its last crc32c check
and ``fstat``s once more after the ``pread``.  The baseline is ``video_pack`` as it was before
(commit 76835d0, read with ``git show``: open, ``fstat``, ``pread`` per GOP), loaded beside the
current one in the same process; blocks alternate between the two, medians are printed.

Run from the repository root: ``python scripts/probe_link_checks.py [--rounds 7] [--n 2000]``.
Prints the time of ``LinkedSegment.packets`` for one frame and 64 frames at random starts, of
``buf[i:i+1]`` and ``buf[i:i+64]`` through a read-only buffer of a linked LeRobot import (4
episodes of 300 frames, 96x128, AV1), one ``fstat``, and the checksum passes the current code
made (one per segment opened: none per read).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lerobot_fixture import write_v3  # noqa: E402

import trajstore.storage.fields.video as video  # noqa: E402
from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.interop import import_lerobot  # noqa: E402
from trajstore.storage.fields import video_pack as new_vp  # noqa: E402
from trajstore.storage.location import resolve_location  # noqa: E402

BASELINE = "76835d0"
CAM = "observation.images.top"
TOP = f"step_data/{CAM}"
LENGTHS = [300] * 4


def baseline() -> types.ModuleType:
    """``video_pack`` as of :data:`BASELINE`, as a module of its own."""
    src = subprocess.run(["git", "show", f"{BASELINE}:trajstore/storage/fields/video_pack.py"], capture_output=True,
                         text=True, check=True).stdout
    mod = types.ModuleType("baseline_video_pack")
    exec(compile(src, "baseline_video_pack", "exec"), mod.__dict__)
    return mod


def _order(r: int) -> tuple[str, str]:
    return ("old", "new") if r % 2 == 0 else ("new", "old")


def micro(store: str, mods: dict[str, types.ModuleType], rounds: int, n: int, rng: np.random.Generator) -> None:
    """``LinkedSegment.packets`` of 1 and 64 frames (us per call, medians over ``rounds``)."""
    loc = resolve_location(store, read_only=True, must_exist=True)
    data = np.frombuffer(Path(f"{store}/{TOP}/video/300").read_bytes(), np.uint8)
    segs = {name: m.open_linked(loc, TOP, data, 300, "probe") for name, m in mods.items()}
    got: dict[tuple[str, int], list[float]] = {(name, w): [] for name in segs for w in (1, 64)}
    for r in range(rounds):
        for w in (1, 64):
            starts = rng.integers(0, 300 - w, n).tolist()
            for name in _order(r):
                seg, t = segs[name], time.perf_counter()
                for i in starts:
                    seg.packets(i, i + w)
                got[(name, w)].append((time.perf_counter() - t) / n * 1e6)
    for w in (1, 64):
        o, c = float(np.median(got[("old", w)])), float(np.median(got[("new", w)]))
        print(f"packets({w} frames): old {o:.2f} us, new {c:.2f} us, +{c - o:.2f} us ({c / o:.3f}x)")
    loc.close()


def end_to_end(store: str, mods: dict[str, types.ModuleType], rounds: int, rng: np.random.Generator) -> None:
    """``buf[i:i+w]`` (ms per read, medians over ``rounds``), a fresh read-only buffer per block
    with ``video.open_linked`` set to the module's (every segment opened before the clock starts)."""
    total, reads = sum(LENGTHS), {1: 300, 64: 30}
    got: dict[tuple[str, int], list[float]] = {(name, w): [] for name in mods for w in (1, 64)}
    for r in range(rounds):
        for w in (1, 64):
            starts = rng.integers(0, total - w, reads[w]).tolist()
            for name in _order(r):
                video.open_linked = mods[name].open_linked
                with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
                    buf[0:total]["step_data"]
                    t = time.perf_counter()
                    for i in starts:
                        buf[i : i + w]["step_data"]
                    got[(name, w)].append((time.perf_counter() - t) / reads[w] * 1e3)
    video.open_linked = new_vp.open_linked
    for w in (1, 64):
        o, c = float(np.median(got[("old", w)])), float(np.median(got[("new", w)]))
        print(f"buf[i:i+{w}]: old {o:.3f} ms, new {c:.3f} ms ({c / o:.3f}x)")


def main() -> None:
    """Build the linked store, run both probes, print one ``fstat``'s cost and the checksum passes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000, help="packets() calls per block")
    args = ap.parse_args()
    mods = {"old": baseline(), "new": new_vp}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_v3(f"{tmp}/v3", LENGTHS, (CAM,), size=(96, 128))
        import_lerobot(f"{tmp}/v3", f"{tmp}/s", link=True)
        time.sleep(new_vp.SETTLE_NS / 1e9 + 0.1)  # the packs' ctime settled: their stamps trusted
        before = new_vp.checks_done()
        micro(f"{tmp}/s", mods, args.rounds, args.n, rng)
        end_to_end(f"{tmp}/s", mods, args.rounds, rng)
        fd = os.open(f"{tmp}/s/{TOP}/video/pack/0", os.O_RDONLY)
        t = time.perf_counter()
        for _ in range(100000):
            os.fstat(fd)
        print(f"one fstat: {(time.perf_counter() - t) / 100000 * 1e6:.2f} us")
        os.close(fd)
        print(f"checksum passes (current code): {new_vp.checks_done() - before} "
              f"(segments opened: 1 + {args.rounds * 2} buffers x {len(LENGTHS)})")


if __name__ == "__main__":
    main()
