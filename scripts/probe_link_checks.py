"""Per-read cost of the linked-segment change check (trajstore.storage.fields.video_pack): each
GOP read of a linked segment compares the pack's ``fstat`` with the one of its last crc32c check
and ``fstat``s once more after the ``pread``.  The baseline is the read the segment made before
that check existed, written out here: the pack opened through the store's confined open (with its
``fstat``), the size compared, one ``pread`` of the frames' span, closed, split per packet.  Blocks alternate between
the two in one process; medians are printed.

Run from the repository root: ``python scripts/probe_link_checks.py [--rounds 7] [--n 2000]``.
Prints the time of ``LinkedSegment.packets`` for one frame and 64 frames at random starts next to
the baseline read of the same spans, of ``buf[i:i+1]`` and ``buf[i:i+64]`` through a read-only
buffer of a linked LeRobot import (4 episodes of 300 frames, 96x128, AV1), one ``fstat``, and the
checksum passes the current code made (one per segment opened: none per read).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lerobot_fixture import write_v3  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.interop import import_lerobot  # noqa: E402
from trajstore.storage.confined import pread  # noqa: E402
from trajstore.storage.fields import video_pack  # noqa: E402
from trajstore.storage.location import Location, resolve_location  # noqa: E402

CAM = "observation.images.top"
TOP = f"step_data/{CAM}"
LENGTHS = [300] * 4


def plain_read(loc: Location, seg: video_pack.LinkedSegment, i: int, j: int) -> list[np.ndarray]:
    """The packets of frames ``[i, j)`` as ``LinkedSegment.packets`` returned them before the change
    check: the pack opened (with its ``fstat``), its size compared, one ``pread`` of their span,
    closed, the span split into one array per packet."""
    off, size = seg.offsets[i:j], seg.sizes[i:j]
    lo, hi = int(off.min()), int((off + size).max())
    fd, st = loc.open_inside(seg.pack_key, os.O_RDONLY, with_stat=True)
    try:
        if st.st_size < seg.b:
            raise ValueError("pack too short")
        buf = np.frombuffer(pread(fd, hi - lo, lo), np.uint8)
    finally:
        os.close(fd)
    return [buf[o - lo : o - lo + s] for o, s in zip(off.tolist(), size.tolist())]


def micro(store: str, rounds: int, n: int, rng: np.random.Generator) -> None:
    """``LinkedSegment.packets`` of 1 and 64 frames against :func:`plain_read` of the same spans
    (us per call, medians over ``rounds``)."""
    loc = resolve_location(store, read_only=True, must_exist=True)
    data = np.frombuffer(Path(f"{store}/{TOP}/video/300").read_bytes(), np.uint8)
    seg = video_pack.open_linked(loc, TOP, data, 300, "probe")
    calls = {"before": lambda i, j: plain_read(loc, seg, i, j), "now": seg.packets}
    got: dict[tuple[str, int], list[float]] = {(name, w): [] for name in calls for w in (1, 64)}
    for r in range(rounds):
        for w in (1, 64):
            starts = rng.integers(0, 300 - w, n).tolist()
            for name in (("before", "now") if r % 2 == 0 else ("now", "before")):
                fn, t = calls[name], time.perf_counter()
                for i in starts:
                    fn(i, i + w)
                got[(name, w)].append((time.perf_counter() - t) / n * 1e6)
    for w in (1, 64):
        o, c = float(np.median(got[("before", w)])), float(np.median(got[("now", w)]))
        print(f"packets({w} frames): before {o:.2f} us, now {c:.2f} us, +{c - o:.2f} us ({c / o:.3f}x)")
    loc.close()


def end_to_end(store: str, rounds: int, rng: np.random.Generator) -> None:
    """``buf[i:i+w]`` (ms per read, medians over ``rounds``), a fresh read-only buffer per block
    (every segment opened before the clock starts)."""
    total, reads = sum(LENGTHS), {1: 300, 64: 30}
    got: dict[int, list[float]] = {1: [], 64: []}
    for _ in range(rounds):
        for w in (1, 64):
            starts = rng.integers(0, total - w, reads[w]).tolist()
            with TrajectoryReplayBuffer.load_from(store, read_only=True) as buf:
                buf[0:total]["step_data"]
                t = time.perf_counter()
                for i in starts:
                    buf[i : i + w]["step_data"]
                got[w].append((time.perf_counter() - t) / reads[w] * 1e3)
    for w in (1, 64):
        print(f"buf[i:i+{w}]: {float(np.median(got[w])):.3f} ms")


def main() -> None:
    """Build the linked store, run both probes, print one ``fstat``'s cost and the checksum passes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n", type=int, default=2000, help="packets() calls per block")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        write_v3(f"{tmp}/v3", LENGTHS, (CAM,), size=(96, 128))
        import_lerobot(f"{tmp}/v3", f"{tmp}/s", link=True)
        time.sleep(video_pack.SETTLE_NS / 1e9 + 0.1)  # the packs' ctime settled: their stamps trusted
        before = video_pack.checks_done()
        micro(f"{tmp}/s", args.rounds, args.n, rng)
        end_to_end(f"{tmp}/s", args.rounds, rng)
        fd = os.open(f"{tmp}/s/{TOP}/video/pack/0", os.O_RDONLY)
        t = time.perf_counter()
        for _ in range(100000):
            os.fstat(fd)
        print(f"one fstat: {(time.perf_counter() - t) / 100000 * 1e6:.2f} us")
        os.close(fd)
        print(f"checksum passes (current code): {video_pack.checks_done() - before} "
              f"(segments opened: 1 + {args.rounds * 2} buffers x {len(LENGTHS)})")


if __name__ == "__main__":
    main()
