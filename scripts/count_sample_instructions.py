"""Instructions per ``sample(256)`` call of a read-only ReplayBuffer of (17,) float32 rows, next to
the numpy memmap gather of the same rows (``a[rng.integers(0, n, 256)]``), counted by valgrind's
callgrind: a count that load on the machine does not change, unlike wall time.

Each system runs in its own process under callgrind: it opens the store, makes ``--warm`` calls
(steady state: what is counted is the per-call work, not first-call costs), then the counters are
zeroed on entering libc's ``getppid`` (``os.getppid()``) and dumped on entering ``getpgrp``
(``os.getpgrp()``), with ``--calls`` calls between.  ``--timing`` also times both natively in
alternating blocks of 25 calls (indicative: wall time moves with the machine's load).

    python scripts/count_sample_instructions.py                    # 1e6 rows, 300 calls each
    python scripts/count_sample_instructions.py --rows 100000 --timing
    python scripts/count_sample_instructions.py --keep /tmp/cg     # keep callgrind files (callgrind_annotate)
    python scripts/count_sample_instructions.py --store /tmp/s --tree /tmp/base   # another checkout's trajstore
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BATCH = 256
SYSTEMS = ("trajstore", "memmap")


def build(d: Path, n: int) -> None:
    """A trajstore store (``d/raw``, capacity ``n``, raw chunks) and ``d/mm.npy`` of the same ``n`` rows."""
    import gymnasium as gym

    from trajstore import ReplayBuffer

    rb = ReplayBuffer.create(gym.spaces.Box(-np.inf, np.inf, (17,), np.float32), cache_path=d / "raw", capacity=n,
                             overwrite=True)
    mm = np.lib.format.open_memmap(d / "mm.npy", mode="w+", dtype=np.float32, shape=(n, 17))
    for lo in range(0, n, 65536):
        x = np.random.default_rng(lo).standard_normal((min(65536, n - lo), 17), dtype=np.float32)
        rb.extend(x)
        mm[lo : lo + len(x)] = x
    rb.close()
    mm.flush()


def sampler(system: str, d: Path, seed: int = 0) -> Callable[[], Any]:
    """``system``'s sample(256), freshly opened (as scripts/bench_peers.py opens them)."""
    g = np.random.default_rng(seed)
    if system == "memmap":
        a = np.load(d / "mm.npy", mmap_mode="r")
        n = len(a)
        return lambda: a[g.integers(0, n, BATCH)]
    from trajstore import ReplayBuffer

    rb = ReplayBuffer.load_from(d / "raw", read_only=True)
    return lambda: rb.sample(BATCH, rng=g)


def child(system: str, d: Path, warm: int, calls: int) -> None:
    """Run under callgrind: warm up, then the counted calls between getppid and getpgrp."""
    fn = sampler(system, d)
    for _ in range(warm):
        fn()
    os.getppid()  # callgrind --zero-before=getppid
    for _ in range(calls):
        fn()
    os.getpgrp()  # callgrind --dump-before=getpgrp


def count(system: str, d: Path, warm: int, calls: int, out: Path, tree: Path) -> float:
    """Instructions per call of ``system`` (callgrind)."""
    prefix = out / f"callgrind.{system}"
    for f in glob.glob(f"{prefix}*"):
        os.remove(f)
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={prefix}",
           "--zero-before=getppid",
           "--dump-before=getpgrp", sys.executable, __file__, "--child", system, "--dir", str(d),
           "--warm", str(warm), "--calls", str(calls), "--tree", str(tree)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The dump at getpgrp, main thread: the counted calls only (zarr's IO thread idles meanwhile).
    # Its summary is the main thread's cost over them (what callgrind_annotate totals).
    part = f"{prefix}.1-01"
    m = re.search(r"^summary: (\d+)", Path(part).read_text(), re.M)
    if m is None:
        raise RuntimeError(f"no totals in {part}")
    return int(m.group(1)) / calls


def timing(d: Path, blocks: int) -> dict[str, np.ndarray]:
    """Seconds per call of both systems, alternating blocks of 25 calls (no warm-up)."""
    fns = {s: sampler(s, d) for s in SYSTEMS}
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(blocks):
        for s in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
            fn, ts = fns[s], times[s]
            for _ in range(25):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
    return {s: np.asarray(v) for s, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--calls", type=int, default=300, help="calls counted per system")
    p.add_argument("--warm", type=int, default=50, help="calls before counting")
    p.add_argument("--timing", action="store_true", help="also time both natively (indicative under load)")
    p.add_argument("--blocks", type=int, default=80, help="--timing: blocks of 25 calls per system")
    p.add_argument("--keep", type=Path, default=None, help="folder for the callgrind files (kept)")
    p.add_argument("--store", type=Path, default=None, help="folder of the stores (built there once, then reused)")
    p.add_argument("--tree", type=Path, default=ROOT, help="checkout whose trajstore is counted (default: this one)")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.insert(0, str(a.tree))  # (the store is built, and --timing runs, with that trajstore too)
    if a.child:
        child(a.child, a.dir, a.warm, a.calls)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = a.store or Path(tmp)
        if not (d / "mm.npy").exists() or len(np.load(d / "mm.npy", mmap_mode="r")) != a.rows:
            d.mkdir(parents=True, exist_ok=True)
            build(d, a.rows)
        out = a.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        per = {s: count(s, d, a.warm, a.calls, out, a.tree) for s in SYSTEMS}
        print(f"sample({BATCH}) of {a.rows:,} (17,) f32 rows, instructions per call (callgrind, {a.calls} calls "
              f"after {a.warm}; trajstore of {a.tree}):")
        for s in SYSTEMS:
            print(f"  {s:10s} {per[s]:12,.0f}  {per[s] / per['memmap']:.2f}x memmap")
        if a.timing:
            ts = timing(d, a.blocks)
            mm = ts["memmap"]
            print(f"wall time, {a.blocks} blocks of 25 calls each (load {os.getloadavg()[0]:.2f}):")
            for s in SYSTEMS:
                t = ts[s]
                print(f"  {s:10s} mean {t.mean() * 1e6:7.1f} us  median {np.median(t) * 1e6:7.1f} us  "
                      f"mean {t.mean() / mm.mean():.2f}x  median {np.median(t) / np.median(mm):.2f}x memmap")


if __name__ == "__main__":
    main()
