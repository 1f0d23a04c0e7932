"""What ``import trajstore`` costs beyond importing zarr, numpy and gymnasium (target: 50 ms).

Each measurement is a fresh interpreter that imports zarr, numpy and gymnasium, then trajstore,
timing the second step; median of ``--runs`` interpreters.  Measured twice: with bytecode caches
(``__pycache__``, what an installed package has after its first import) and without them
(``PYTHONDONTWRITEBYTECODE=1``: an editable install's modules compiled on every import; installed
libraries keep the caches pip wrote).

    python scripts/bench_import.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import section

_PROBE = ("import time; t=time.perf_counter(); import zarr, numpy, gymnasium; t1=time.perf_counter(); "
          "import trajstore; t2=time.perf_counter(); print(t1 - t, t2 - t1)")


def measure(runs: int, cached: bool) -> tuple[float, float]:
    """Median seconds of (zarr+numpy+gymnasium, trajstore on top) over ``runs`` interpreters."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as prefix:
        if cached:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = prefix  # a private cache: the tree is left as it was
        else:
            # Site-packages keep the caches pip wrote; an editable tree without __pycache__ is
            # compiled on every import (this project's CI machines set PYTHONDONTWRITEBYTECODE).
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        base, ours = [], []
        for i in range(runs + (1 if cached else 0)):
            out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
            if cached and i == 0:
                continue  # the run that writes the caches
            b, o = (float(x) for x in out.stdout.split())
            base.append(b)
            ours.append(o)
    return statistics.median(base), statistics.median(ours)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="3 runs each")
    a = ap.parse_args(argv)
    runs = 3 if a.quick else a.runs
    lines = ["| bytecode | zarr + numpy + gymnasium | trajstore on top | target |", "|---|---|---|---|"]
    for cached in (True, False):
        base, ours = measure(runs, cached)
        lines.append(f"| {'cached' if cached else 'compiled afresh'} | {base * 1e3:.0f} ms | {ours * 1e3:.0f} ms | "
                     f"<= 50 ms{'' if cached else ' (not a target: a first import only)'} |")
    return section("Import time (scripts/bench_import.py)", "bench_import.py", argv,
                   runs=f"medians of {runs} fresh interpreters per row.",
                   body="`import trajstore` in a fresh interpreter, after its dependencies.\n\n" + "\n".join(lines),
                   quick=a.quick or runs < 5, started=started)


if __name__ == "__main__":
    print(main())
