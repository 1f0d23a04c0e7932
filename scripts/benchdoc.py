"""What every section of docs/benchmarks.md says about itself: the exact command, the date, the
machine, the versions of Python, numpy, zarr and the peers measured, and how many runs stand
behind each median.  Each ``scripts/bench_*.py`` returns its section from ``main(argv) -> str``
through :func:`section`; ``scripts/bench_all.py`` puts the sections together.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
#: the packages every section names (peers and torch are added by the sections that use them)
BASE_PACKAGES = ("numpy", "zarr")


def versions(*packages: str) -> str:
    """``"Python 3.11.7, trajstore 0.1.0 (git 1a2b3c4), numpy 2.4.6, zarr 3.1.6, ..."``: the code
    imported now is the code measured (a dirty tree says so)."""
    out = [f"Python {platform.python_version()}"]
    try:
        ts = f"trajstore {version('trajstore')}"
    except PackageNotFoundError:
        ts = "trajstore (not installed)"
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "trajstore"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if rev:
            ts += f" (git {rev}{' with uncommitted changes in trajstore/' if dirty else ''})"
    except (OSError, subprocess.SubprocessError):
        pass
    out.append(ts)
    for pkg in dict.fromkeys((*BASE_PACKAGES, *packages)):
        try:
            out.append(f"{pkg} {version(pkg)}")
        except PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def machine(store_dir: Path | None = None) -> str:
    """CPUs, RAM and kernel (and the filesystem of ``store_dir`` when given)."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = "?"
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
        ram = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    out = f"{os.cpu_count()} CPUs ({cpu}), {ram} RAM, Linux {platform.release()}"
    if store_dir is None:
        return out
    fs, best = "?", ""
    try:
        real = os.path.realpath(store_dir)
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, right = line.split(" - ", 1)
                mnt = left.split()[4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fs = mnt, f"{right.split()[0]} ({right.split()[1]} on {mnt})"
    except OSError:
        pass
    return f"{out}, store folder on {fs}"


def section(title: str, script: str, argv: Sequence[str], *, runs: str, body: str, quick: bool,
            started: float, packages: Sequence[str] = (), store_dir: Path | None = None) -> str:
    """The markdown section ``## title``: command, date, machine, versions, ``runs`` (how many runs
    stand behind each median), then ``body`` (a few sentences and the tables).

    ``started`` is the ``time.perf_counter()`` at the script's start (the section says how long it
    took); ``packages`` are the peers and libraries the section measures beside numpy and zarr.
    """
    cmd = " ".join(["python", f"scripts/{script}", *map(shlex.quote, argv)])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"## {title}", ""]
    if quick:
        head += ["**QUICK RUN (tiny sizes, a smoke test): not a measurement.**", ""]
    head += [f"Command: `{cmd}`; run {date}, took {time.perf_counter() - started:.0f} s.", "",
             f"Machine: {machine(store_dir)}. Versions: {versions(*packages)}.", "",
             f"Runs: {runs}", "", body.strip("\n"), ""]
    return "\n".join(head)


def cold_steady_note(block: int, cold: int) -> str:
    """The sentence every cold/steady table shares (how calls are timed)."""
    return (f"Calls run in blocks of {block} consecutive calls per system (not single calls interleaved), "
            f"the systems' order rotated each round; no read pass before timing (a training loop does none); "
            f"cold = the first {cold} calls after a fresh open, steady = the calls after those.")
