"""What filling the 2 MiB pieces of new chunk files with zeros costs the writer: ``extend`` of a
ring with ``trajstore.storage.fields.folios.FILL_FOLIOS`` on and off, in one process, the two in
turn (who goes first alternates), each build timed from ``create`` to ``close``; with
``--drop-caches`` (root) the page cache is emptied before each (``sync``, ``/proc/sys/vm/drop_caches``),
so that neither build meets the other's dirty pages.  The read side of the same change: scripts/probe_read_faults.py
(``raw`` against ``raw-nofill``).

    python scripts/probe_writer_folios.py --drop-caches        # the three cases below, 6 rounds
    python scripts/probe_writer_folios.py --rows 20000 --block 256 --shape 84,84,4

Prints one line per case: the median seconds per build with and without, and every round.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gymnasium.spaces import Box  # noqa: E402

from trajstore import ReplayBuffer  # noqa: E402
from trajstore.storage.fields import folios  # noqa: E402

#: (rows, rows per extend, row shape): a 1e7 ring filled by 65,536-row extends (bench_peers.py's
#: build; the ring writes 4,096-row blocks), 1,000-row extends, and frames in 256-row extends.
CASES = [(10_000_000, 65_536, (17,)), (3_000_000, 1_000, (17,)), (20_000, 256, (84, 84, 4))]


def _drop_caches() -> None:
    """Write dirty pages out and drop the clean ones (root only; a no-op otherwise)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass  # not root: the page cache stays as it is (both builds alike)


def build_time(root: Path, n: int, block: int, shape: tuple[int, ...], fill: bool, drop: bool = False) -> float:
    """Seconds to create a ring of ``n`` rows of ``shape``, extend it ``block`` rows at a time, close it."""
    frames = len(shape) == 3
    space = Box(0, 255, shape, np.uint8) if frames else Box(-np.inf, np.inf, shape, np.float32)
    x = np.random.default_rng(0).standard_normal((block, *shape)).astype(np.uint8 if frames else np.float32)
    path = root / ("fill" if fill else "nofill")
    folios.FILL_FOLIOS = fill
    if drop:
        _drop_caches()
    try:
        t = time.perf_counter()
        with ReplayBuffer.create(space, cache_path=path, capacity=n, overwrite=True) as rb:
            for lo in range(0, n, block):
                rb.extend(x[: min(block, n - lo)])
        return time.perf_counter() - t
    finally:
        folios.FILL_FOLIOS = True
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=None, help="one case: rows of the ring")
    ap.add_argument("--block", type=int, default=1000, help="one case: rows per extend")
    ap.add_argument("--shape", default="17", help="one case: row shape, e.g. 17 or 84,84,4")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each build (root)")
    ap.add_argument("--dir", type=Path, default=None, help="folder for the stores (default: a temp folder)")
    a = ap.parse_args(argv)
    cases = [(a.rows, a.block, tuple(int(v) for v in a.shape.split(",")))] if a.rows else CASES
    root = Path(tempfile.mkdtemp(prefix="probe_writer_folios_", dir=a.dir))
    out = []
    try:
        for n, block, shape in cases:
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(a.rounds):
                for fill in ((False, True) if r % 2 == 0 else (True, False)):
                    times[fill].append(build_time(root, n, block, shape, fill, a.drop_caches))
            res = {"rows": n, "block": block, "shape": shape,
                   "fill_s": float(np.median(times[True])), "nofill_s": float(np.median(times[False])),
                   "rounds": a.rounds}
            out.append(res)
            print(f"{n:,} rows of {shape} in extends of {block:,}: fill {res['fill_s']:.3f} s, "
                  f"no fill {res['nofill_s']:.3f} s (medians of {a.rounds}; fill "
                  f"{[round(t, 3) for t in times[True]]}, no fill {[round(t, 3) for t in times[False]]}; "
                  f"load average {os.getloadavg()[0]:.2f})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


if __name__ == "__main__":
    main()
