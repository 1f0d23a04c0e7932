"""open_diffusion_policy benchmark: a Diffusion Policy store read in place against the same store
imported into trajstore's own layout (import_diffusion_policy), and against plain zarr-python
reads of the same rows, all in one process.

    python scripts/bench_open_dp.py            # 20,000 rows: img (64,64,3) u8, state (5,), action (2,) f32
    python scripts/bench_open_dp.py --quick    # 4,000 rows (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).

The store is written as Diffusion Policy's ReplayBuffer writes it (zarr format 2, Blosc lz4, no
shuffle, chunks of 100 rows). Each reader runs in blocks of consecutive calls (bench_core's
run_blocks); cold = mean of the first 200 calls after opening (no warm-up pass), steady = mean of
the rest. Ratios are against the imported copy (ratio > 1: slower than the copy). Plain zarr-python
(``oindex`` of the same number of sorted random rows, every array) is timed over 50 calls only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numcodecs
import numpy as np
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import BLOCK, COLD, run_blocks  # noqa: E402
from benchdoc import cold_steady_note, section  # noqa: E402

from trajstore.interop import import_diffusion_policy, open_diffusion_policy  # noqa: E402


def write_store(path: Path, n: int, chunk: int = 100) -> None:
    """A PushT-like Diffusion Policy store of ``n`` rows in episodes of 100-300 steps."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 300, n // 100 + 1)
    ends = np.cumsum(lengths)
    ends = np.append(ends[ends < n], n).astype(np.int64)
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    comp = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.NOSHUFFLE)
    for key, shape, dtype in (("img", (64, 64, 3), np.uint8), ("state", (5,), np.float32),
                              ("action", (2,), np.float32)):
        a = root.create_array(f"data/{key}", shape=(n, *shape), chunks=(chunk, *shape), dtype=dtype, compressors=comp)
        for lo in range(0, n, 2000):
            hi = min(lo + 2000, n)
            a[lo:hi] = (rng.integers(0, 255, (hi - lo, *shape)) if dtype == np.uint8
                        else rng.standard_normal((hi - lo, *shape))).astype(dtype)
    root.create_array("meta/episode_ends", shape=ends.shape, dtype=np.int64, compressors=None)[:] = ends


def measure(path: Path, copy_path: Path, calls: int) -> list[tuple[str, str, float, float]]:
    """(what, reader, cold ms, steady ms) rows."""
    out = []
    work: dict[str, Callable[[Any, np.random.Generator], Any]] = {
        "sample(256)": lambda b, g: b.sample(256, rng=g),
        "sample_sequences(64, 16)": lambda b, g: b.sample_sequences(64, 16, rng=g, within_episode=True),
    }
    for what, fn in work.items():
        # each reader freshly opened just before its calls, so the first COLD calls are cold
        dp, copy = open_diffusion_policy(path), import_or_open(copy_path)
        root = zarr.open_group(str(path), mode="r")
        arrays = [root[f"data/{k}"] for k in ("img", "state", "action")]
        g = {k: np.random.default_rng(i) for i, k in enumerate(("in place", "copy", "zarr"))}
        systems = {"in place": lambda: fn(dp, g["in place"]), "copy": lambda: fn(copy, g["copy"])}
        times = run_blocks(systems, calls)
        for name, t in times.items():
            out.append((what, name, 1e3 * float(t[:COLD].mean()), 1e3 * float(t[COLD:].mean())))
        if what == "sample(256)":  # plain zarr-python, the reference without trajstore: 50 calls (slow)
            n = len(dp)
            t = run_blocks({"zarr": lambda: [a.oindex[np.sort(g["zarr"].integers(0, n, 256))] for a in arrays]}, 50)
            out.append((what, "zarr oindex (50 calls)", 1e3 * float(t["zarr"].mean()), 1e3 * float(t["zarr"].mean())))
        dp.close()
        copy.close()
    return out


def import_or_open(copy_path: Path) -> Any:
    from trajstore import TrajectoryReplayBuffer

    return TrajectoryReplayBuffer.load_from(copy_path, read_only=True)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--calls", type=int, default=1000, help="calls of each reader (the first 200: cold)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.calls = 2_000, 250
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path, copy_path = Path(d) / "dp.zarr", Path(d) / "copy"
        write_store(path, args.rows)
        t = time.perf_counter()
        open_diffusion_policy(path).close()
        opened = time.perf_counter() - t
        t = time.perf_counter()
        import_diffusion_policy(path, copy_path, tqdm=False).close()
        imported = time.perf_counter() - t
        rows = measure(path, copy_path, args.calls)
    lines = ["| call | reader | cold ms | steady ms | cold vs copy | steady vs copy |", "|---|---|---|---|---|---|"]
    base = {what: (c, s) for what, name, c, s in rows if name == "copy"}
    for what, name, c, s in rows:
        lines.append(f"| {what} | {name} | {c:.2f} | {s:.2f} | {c / base[what][0]:.2f}x | {s / base[what][1]:.2f}x |")
    lines += ["", "| operation | time |", "|---|---|", f"| `open_diffusion_policy` | {1e3 * opened:.1f} ms |",
              f"| `import_diffusion_policy` | {imported:.2f} s |"]
    body = (f"A Diffusion Policy store of {args.rows:,} PushT-like rows (img (64,64,3) uint8, state (5,), action (2,) "
            "f32; zarr format 2, Blosc lz4, chunks of 100 rows) read in place (`open_diffusion_policy`) against "
            "the same store imported into trajstore's layout (`import_diffusion_policy`), both opened just before "
            "their calls. " + cold_steady_note(BLOCK, COLD) + " Plain zarr-python (`oindex` of 256 sorted random "
            "rows of every array) is timed over 50 calls only (its cold and steady columns are the same mean).\n\n"
            + "\n".join(lines))
    return section("Diffusion Policy stores in place (scripts/bench_open_dp.py)", "bench_open_dp.py", argv,
                   runs="one run: cold is the mean of each reader's first 200 calls, steady of the rest; open and "
                        "import: one each.", body=body, quick=args.quick, started=started)


if __name__ == "__main__":
    print(main())
