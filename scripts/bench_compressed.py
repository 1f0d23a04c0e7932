"""Compressed image rows: random reads per row block vs whole chunks, against the raw layout.

Measures (issue 12, points 3 and 5), all in one process, page cache warm:

* random ``sample(256)`` and random single-row reads (``rb[i]``) of (64, 64, 3) uint8 rows on
  - ``raw``: the uncompressed (memory-mapped) layout,
  - ``lz4``: the current compressed layout (one blosc block per row, rows decoded alone),
  - ``lz4-old``: the previous layout (blosc lz4 with auto-sized blocks) read the previous way
    (whole chunks through zarr, 256 MiB decoded-chunk LRU): "before";
  and the ratio lz4 / raw (target >= 0.25);
* a sequential scan (``read_contiguous`` of every row, what copy / stats / dask export do),
  before (``lz4-old``, previous code path) and after (``lz4``);
* remote (s3:// on a local moto server; skipped without moto/s3fs, or with --no-remote): a cold
  random batch of 256 rows (caches dropped first): S3 requests per batch, the most requests in
  flight at once (counted in a hook on s3fs's request call) and ms per batch, before (previous
  path: zarr ``oindex``) and after (all chunks of the batch fetched concurrently).

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there);
``measure`` returns the results, which the script run alone prints as JSON on its last line.  ``--quick`` (a few seconds) uses small stores and
lowers ``ROW_READS_ABOVE_BYTES`` so that the small fields take the row path they take at size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import zarr
from gymnasium.spaces import Box

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MotoS3
from benchdoc import section

from trajstore import ReplayBuffer
from trajstore.storage.fields import chunked

ROW = (64, 64, 3)
SPACE = Box(0, 255, ROW, np.uint8)
OLD_CODEC = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=1)  # previous "lz4"


def frames(n: int, seed: int = 0) -> np.ndarray:
    """Atari-like synthetic frames: flat background, a band of texture, a few sprites."""
    rng = np.random.default_rng(seed)
    x = np.full((n, *ROW), 40, np.uint8)
    x[:, 40:48] = rng.integers(0, 255, (n, 8, 64, 3), dtype=np.uint8)
    for s in range(4):
        r = rng.integers(0, 56, n)
        c = rng.integers(0, 56, n)
        for i in range(n):
            x[i, r[i] : r[i] + 8, c[i] : c[i] + 8] = 60 * s + 30
    return x


def build(path: str, data: np.ndarray, compressor, storage_options=None) -> None:
    with ReplayBuffer.create(SPACE, cache_path=path, compressor=compressor, overwrite=True,
                             storage_options=storage_options) as rb:
        for lo in range(0, len(data), 500):
            rb.extend(data[lo : lo + 500])


def old_path(rb: ReplayBuffer) -> None:
    """Read ``rb`` the previous way: whole chunks through zarr into the decoded-chunk LRU."""
    for f in rb._table.fields:
        if isinstance(f, chunked.ChunkedField):
            f._partial = False


def rate(fn, seconds: float, min_calls: int = 3) -> float:
    """Calls per second of ``fn`` (after one warm-up call), for about ``seconds``."""
    fn()
    n, t0 = 0, time.perf_counter()
    while n < min_calls or time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0)


def local(args, root: Path, data: np.ndarray) -> dict:
    n = len(data)
    paths = {"raw": str(root / "raw"), "lz4": str(root / "lz4"), "lz4-old": str(root / "lz4-old")}
    t0 = time.perf_counter()
    build(paths["raw"], data, None)
    build(paths["lz4"], data, "lz4")
    build(paths["lz4-old"], data, OLD_CODEC)
    print(f"built 3 stores of {n} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sizes = {k: sum(f.stat().st_size for f in Path(p).rglob("c/**/*") if f.is_file()) for k, p in paths.items()}
    res: dict = {"rows": n, "row_bytes": int(np.prod(ROW)), "bytes_on_disk": sizes}
    rng = np.random.default_rng(0)
    sample, single, scan = {}, {}, {}
    for name, p in paths.items():
        rb = ReplayBuffer.load_from(p, read_only=True)
        if name == "lz4-old":
            old_path(rb)
        got = rb[np.arange(0, n, 97)]
        assert (got == data[::97]).all(), name
        sample[name] = 256 * rate(lambda rb=rb: rb.sample(256, rng=rng), args.seconds)
        single[name] = rate(lambda rb=rb: rb[int(rng.integers(n))], args.seconds, 50)
        scan[name] = n * rate(lambda rb=rb: rb[:], args.seconds, 1)
        rb.close()
    res["sample256"] = {"rows_per_s": sample, "ratio": sample["lz4"] / sample["raw"],
                        "ratio_before": sample["lz4-old"] / sample["raw"]}
    res["single_row"] = {"rows_per_s": single, "ratio": single["lz4"] / single["raw"],
                         "ratio_before": single["lz4-old"] / single["raw"]}
    res["scan"] = {"old_rows_per_s": scan["lz4-old"], "new_rows_per_s": scan["lz4"], "raw_rows_per_s": scan["raw"]}
    for what in ("sample256", "single_row"):
        r = res[what]
        print(f"{what:10s} rows/s  raw {r['rows_per_s']['raw']:10.0f}  lz4 {r['rows_per_s']['lz4']:9.0f} "
              f"(x{r['ratio']:.3f} of raw)  before (lz4-old) {r['rows_per_s']['lz4-old']:8.0f} "
              f"(x{r['ratio_before']:.4f})", file=sys.stderr)
    print(f"scan       rows/s  before {scan['lz4-old']:.0f}  after {scan['lz4']:.0f}  raw {scan['raw']:.0f}",
          file=sys.stderr)
    print(f"bytes on disk {sizes}", file=sys.stderr)
    return res


# ------------------------------------------------------------------------------------------ remote
class S3Hook:
    """Counts S3 requests and the most in flight at once (a wrapper on s3fs's request call)."""

    def __init__(self) -> None:
        import s3fs

        self.calls, self.in_flight, self.max_in_flight = 0, 0, 0
        self._orig = s3fs.S3FileSystem._call_s3
        hook = self

        async def counting(fs, method, *a, **kw):
            hook.calls += 1
            hook.in_flight += 1
            hook.max_in_flight = max(hook.max_in_flight, hook.in_flight)
            try:
                return await hook._orig(fs, method, *a, **kw)
            finally:
                hook.in_flight -= 1

        s3fs.S3FileSystem._call_s3 = counting

    def reset(self) -> None:
        self.calls, self.max_in_flight = 0, 0


def remote(args, data: np.ndarray) -> dict:
    try:
        server = MotoS3()
        opts = {**server.options, "use_listings_cache": False}
    except ImportError as e:
        print(f"remote: skipped ({e})", file=sys.stderr)
        return {}
    try:
        out = {"rows": len(data)}
        for name, comp in (("before", OLD_CODEC), ("after", "lz4")):
            url = f"s3://bench/{uuid.uuid4().hex}"
            build(url, data, comp, opts)
            hook = S3Hook()
            rb = ReplayBuffer.load_from(url, read_only=True, storage_options=opts)
            if name == "before":
                old_path(rb)
            rng = np.random.default_rng(1)
            calls, inflight, ms = [], [], []
            for _ in range(args.remote_batches):
                for f in rb._table.fields:
                    f.drop_cache()
                hook.reset()
                idx = np.sort(rng.choice(len(data), 256, replace=False))
                t0 = time.perf_counter()
                got = rb[idx]
                ms.append((time.perf_counter() - t0) * 1e3)
                assert (got == data[idx]).all()
                calls.append(hook.calls)
                inflight.append(hook.max_in_flight)
            import s3fs

            s3fs.S3FileSystem._call_s3 = hook._orig
            rb.close()
            out[name] = {"gets_per_batch": float(np.median(calls)), "max_in_flight": int(max(inflight)),
                         "ms_per_batch": float(np.median(ms))}
            print(f"remote {name:6s}: {out[name]['gets_per_batch']:.0f} requests per batch of 256, "
                  f"at most {out[name]['max_in_flight']} in flight, {out[name]['ms_per_batch']:.0f} ms per batch "
                  f"(median of {args.remote_batches}, caches dropped before each)", file=sys.stderr)
        return out
    finally:
        server.stop()


def measure(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small stores, short timings (a few seconds)")
    ap.add_argument("--rows", type=int, default=None, help="rows per local store (default 30000; quick 2000)")
    ap.add_argument("--remote-rows", type=int, default=None, help="rows of the s3 store (default 6000; quick 1200)")
    ap.add_argument("--seconds", type=float, default=None, help="time per measurement (default 2; quick 0.2)")
    ap.add_argument("--remote-batches", type=int, default=None, help="cold batches on s3 (default 9; quick 2)")
    ap.add_argument("--no-remote", action="store_true")
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder, removed)")
    args = ap.parse_args(argv)
    q = args.quick
    args.rows = args.rows or (2000 if q else 30000)
    args.remote_rows = args.remote_rows or (1200 if q else 6000)
    args.seconds = args.seconds or (0.2 if q else 2.0)
    args.remote_batches = args.remote_batches or (2 if q else 9)
    if q:  # small fields would otherwise be served from whole cached chunks (they fit the cache)
        chunked.ROW_READS_ABOVE_BYTES = 0
    root = Path(tempfile.mkdtemp(prefix="bench_compressed_", dir=args.dir))
    try:
        data = frames(max(args.rows, args.remote_rows))
        res = {"quick": q, **local(args, root, data[: args.rows])}
        if not args.no_remote:
            r = remote(args, data[: args.remote_rows])
            if r:
                res["remote"] = r
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def table(res: dict) -> str:
    """The section's table from :func:`measure`'s results."""
    s, one, scan, size = res["sample256"], res["single_row"], res["scan"], res["bytes_on_disk"]
    raw = s["rows_per_s"]["raw"]
    lines = ["| measurement | raw | lz4 now | lz4 before |", "|---|---|---|---|",
             f"| random `sample(256)`, rows/s | {raw:,.0f} | {s['rows_per_s']['lz4']:,.0f} ({s['ratio']:.3f}x raw; "
             f"target >= 0.25x) | {s['rows_per_s']['lz4-old']:,.0f} ({s['ratio_before']:.4f}x) |",
             f"| random single rows, rows/s | {one['rows_per_s']['raw']:,.0f} | {one['rows_per_s']['lz4']:,.0f} "
             f"({one['ratio']:.2f}x raw) | {one['rows_per_s']['lz4-old']:,.0f} ({one['ratio_before']:.3f}x) |",
             f"| sequential scan `rb[:]`, rows/s | {scan['raw_rows_per_s']:,.0f} | {scan['new_rows_per_s']:,.0f} | "
             f"{scan['old_rows_per_s']:,.0f} |",
             f"| bytes on disk | {size['raw'] / 1e6:,.1f} MB | {size['lz4'] / 1e6:,.1f} MB | {size['lz4-old'] / 1e6:,.1f} MB |"]
    if "remote" in res:
        r = res["remote"]
        cell = lambda k: (f"{r[k]['gets_per_batch']:.0f} / {r[k]['max_in_flight']} / {r[k]['ms_per_batch']:,.0f}"
                          if k in r else "-")
        lines.append(f"| s3 batch of 256: requests / most in flight / ms | | {cell('after')} | {cell('before')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    res = measure(argv)
    q = res["quick"]
    body = (f"{res['rows']:,} (64,64,3) uint8 rows, one process, page cache warm; \"before\" is the previous lz4 layout "
            "(c-blosc's own block size) read the previous way (whole chunks through zarr, 256 MiB decoded cache); "
            "remote: a moto S3 server on 127.0.0.1, cold batches of 256 (caches dropped). Each image row is its own "
            "blosc block inside ordinary zarr chunks (docs/format.md), so a random row decodes one row.\n\n"
            + table(res))
    return section("Compressed image rows and remote batches (scripts/bench_compressed.py)", "bench_compressed.py",
                   argv, runs=f"local rows/s: calls for {0.2 if q else 2.0:g} s after one warm-up call (a rate, not "
                   f"a median; no cold figure); remote: median of {2 if q else 9} cold batches.",
                   body=body, quick=q, started=started, packages=("s3fs", "moto"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    res = measure()
    print(table(res))
    print(json.dumps(res))
