"""What a freshly opened reader's uniform ``sample(256)`` of one (17,) float32 array pays, next to a
numpy memmap of the same rows, with what decides it: page faults, and how much of the store the
process maps with 2 MiB page-table entries (``FilePmdMapped`` in /proc/self/smaps), which depends on
the page-cache folios the files were written into.

Stores are built as scripts/bench_peers.py builds them (65,536-row ``extend`` calls; page cache warm),
under ``--dir`` (kept: later runs reuse them).  ``raw-1write`` is the raw store with every chunk file
rewritten by one ``write`` each (same bytes): its page cache holds a 2 MiB folio per chunk, which a
reader maps with one fault and one TLB entry.  ``raw-nofill`` is the raw store written with
``trajstore.storage.fields.folios.FILL_FOLIOS`` off (the writer's blocks without the zeros that
fill each 2 MiB piece of a new chunk file: what the writer did before 2026-12-06).  Each round opens every system in a fresh process
(who goes first rotates); times are the thread's CPU time (not wall time: the machine is shared),
cold = mean of the first 200 calls, steady = median of 25-call blocks after those.

    python scripts/probe_read_faults.py --rows 1000000 10000000 --rounds 3
    python scripts/probe_read_faults.py --rows 10000000 --systems raw,raw-1write,mm --folios

``--folios`` (root: /proc/kpageflags) also prints the folio sizes of a few chunk files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("raw", "lz4", "mm", "raw-1write", "raw-nofill")
COLD, BLOCK = 200, 25


def build(d: Path, n: int) -> None:
    """``d/raw``, ``d/lz4``, ``d/raw-nofill``, ``d/mm.npy`` and ``d/raw-1write`` of the same ``n``
    rows (kept if there)."""
    import gymnasium as gym

    from trajstore import ReplayBuffer
    from trajstore.storage.fields import folios as filling

    if not (d / "mm.npy").exists():
        d.mkdir(parents=True, exist_ok=True)
        box = gym.spaces.Box(-np.inf, np.inf, (17,), np.float32)
        rbs = [ReplayBuffer.create(box, cache_path=d / "raw", capacity=n, overwrite=True),
               ReplayBuffer.create(box, cache_path=d / "lz4", capacity=n, compressor="lz4", overwrite=True),
               ReplayBuffer.create(box, cache_path=d / "raw-nofill", capacity=n, overwrite=True)]
        mm = np.lib.format.open_memmap(d / "mm.part.npy", mode="w+", dtype=np.float32, shape=(n, 17))
        for lo in range(0, n, 65536):
            x = np.random.default_rng(lo).standard_normal((min(65536, n - lo), 17), dtype=np.float32)
            for rb in rbs:
                filling.FILL_FOLIOS = rb is not rbs[2]
                rb.extend(x)
            filling.FILL_FOLIOS = True
            mm[lo : lo + len(x)] = x
        for rb in rbs:
            rb.close()
        mm.flush()
        del mm
        os.replace(d / "mm.part.npy", d / "mm.npy")
    if not (d / "raw-1write").exists():
        shutil.copytree(d / "raw", d / "raw-1write.part")
        for p in (d / "raw-1write.part" / "step_data" / "c").rglob("*"):
            if p.is_file():
                data = p.read_bytes()
                p.unlink()
                fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)  # one write: 2 MiB folios where the kernel gives them
                finally:
                    os.close(fd)
        os.replace(d / "raw-1write.part", d / "raw-1write")


def _opener(d: Path, n: int, name: str) -> Callable[[], Any]:
    g = np.random.default_rng(n)
    if name == "mm":
        a = np.load(d / "mm.npy", mmap_mode="r")
        return lambda: a[g.integers(0, n, 256)]
    from trajstore import ReplayBuffer

    rb = ReplayBuffer.load_from(d / name, read_only=True)
    return lambda: rb.sample(256, rng=g)


def _pmd_kib(d: Path) -> dict[str, int]:
    """KiB of files under ``d`` this process maps with 2 MiB entries, per top-level name."""
    out: dict[str, int] = {}
    cur = None
    root = str(d.resolve()) + "/"
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
            if m:
                path = m.group(1)
                cur = path[len(root):].split("/")[0] if path.startswith(root) else None
            elif cur is not None and line.startswith("FilePmdMapped:"):
                out[cur] = out.get(cur, 0) + int(line.split()[1])
    return out


def child(d: Path, n: int, names: list[str], calls: int) -> dict[str, Any]:
    """One round in this process: open every system, run rotated blocks; per system cold/steady ms."""
    fns = {nm: _opener(d, n, nm) for nm in names}
    times: dict[str, list[float]] = {nm: [] for nm in names}
    faults = {nm: [0, 0] for nm in names}
    for r in range(-(-calls // BLOCK)):
        for nm in names[r % len(names):] + names[: r % len(names)]:
            fn, ts = fns[nm], times[nm]
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(BLOCK):
                t = time.thread_time()
                fn()
                ts.append(time.thread_time() - t)
            faults[nm][len(ts) > COLD] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    pmd = _pmd_kib(d)
    out: dict[str, Any] = {}
    for nm, ts in times.items():
        a = np.asarray(ts) * 1e3
        out[nm] = {"cold": float(a[:COLD].mean()), "steady": float(np.median(a[COLD:].reshape(-1, BLOCK).mean(axis=1))),
                   "faults_cold": faults[nm][0], "faults_steady": faults[nm][1],
                   "pmd_mib": pmd.get("mm.npy" if nm == "mm" else nm, 0) / 1024}
    return out


def folios(path: Path) -> list[int]:
    """Sizes (pages) of the page-cache folios holding file ``path`` (root only: /proc/kpageflags)."""
    import mmap

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    a = np.frombuffer(m, np.uint8)
    int(a[::4096].sum())  # fault every page in
    pages = -(-size // 4096)
    with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
        pm.seek(a.ctypes.data // 4096 * 8)
        pfns = (np.frombuffer(pm.read(pages * 8), np.uint64) & np.uint64((1 << 55) - 1)).tolist()
        sizes: list[int] = []
        for p in pfns:
            kf.seek(p * 8)
            tail = struct.unpack("<Q", kf.read(8))[0] & (1 << 16)
            if tail and sizes:
                sizes[-1] += 1
            else:
                sizes.append(1)
    del a
    m.close()
    return sizes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--systems", default="raw,lz4,mm", help=f"comma-separated, of {','.join(SYSTEMS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1200)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/trajstore_probe_read_faults"))
    ap.add_argument("--folios", action="store_true")
    ap.add_argument("--child", nargs=3, metavar=("ROWS", "SYSTEMS", "FIRST"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        n, names, first = int(a.child[0]), a.child[1].split(","), int(a.child[2])
        names = names[first % len(names):] + names[: first % len(names)]
        print(json.dumps(child(a.dir / f"n{n}", n, names, a.calls)))
        return
    names = a.systems.split(",")
    for n in a.rows:
        d = a.dir / f"n{n}"
        build(d, n)
        runs = []
        for r in range(a.rounds):
            cmd = [sys.executable, __file__, "--child", str(n), ",".join(names), str(r), "--dir", str(a.dir),
                   "--calls", str(a.calls)]
            runs.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        print(f"rows {n:,} ({a.rounds} rounds, load average {os.getloadavg()[0]:.2f}): medians, thread CPU ms per call")
        for nm in names:
            med = {k: float(np.median([r[nm][k] for r in runs])) for k in runs[0][nm]}
            mm = {k: float(np.median([r["mm"][k] for r in runs])) for k in ("cold", "steady")} if "mm" in names else None
            rel = f"  x memmap cold {med['cold'] / mm['cold']:.2f} steady {med['steady'] / mm['steady']:.2f}" if mm else ""
            print(f"  {nm:<11} cold {med['cold']:.3f} steady {med['steady']:.3f}  faults cold {med['faults_cold']:.0f} "
                  f"steady {med['faults_steady']:.0f}  2 MiB-mapped {med['pmd_mib']:.0f} MiB{rel}")
        if a.folios:
            for nm in (s for s in names if s != "mm"):
                files = sorted((d / nm / "step_data" / "c").rglob("0"), key=lambda p: p.stat().st_mtime)[:3]
                print(f"  folios (pages) of {nm}:", [sorted(folios(p))[-3:] for p in files if p.is_file()])


if __name__ == "__main__":
    main()
