"""Compressed rows: random reads per row block vs whole chunks, against the raw layout.

Measures (issue 12, points 3 and 5; issue 35, point 4), all in one process, page cache warm:

* vector rows (issue 35): ``sample(256)`` of (17,) float32 rows at 1e6 and 1e7 rows
  (``--vector-rows``) on ``raw``, ``lz4`` (the current layout: small unsplit blosc blocks) and
  ``lz4-old`` (the previous layout: typesize 4, which c-blosc turns into 64 KiB blocks, read by the
  current code), as users run it: each store freshly opened, no read before timing, blocks of 25
  consecutive calls per system, systems rotated (bench_peers.py's rule), cold = the first 200 calls,
  steady = the calls after; the lz4 / raw rate ratio (target >= 0.25) and lz4's time per call at the
  largest size over the smallest (target <= 1.3);

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
VEC = (17,)
#: The previous "lz4" layout of small rows: typesize 4 and 16 KiB asked, 64 KiB blocks written.
OLD_VEC_CODEC = zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=4, blocksize=16 << 10)
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


# ------------------------------------------------------------------------------------------ vectors
def vectors(args, root: Path) -> dict:
    """sample(256) of (17,) float32 rows, raw vs lz4 vs the previous lz4 layout, per store size."""
    from bench_peers import BLOCK, COLD, phases, run_blocks, vec_rows

    space = Box(-np.inf, np.inf, VEC, np.float32)
    out: dict = {"sizes": [], "cold_calls": COLD, "block": BLOCK}
    for k, n in enumerate(args.vector_rows):
        d = root / f"vec_{n}"
        comps = {"raw": None, "lz4": "lz4", "lz4-old": OLD_VEC_CODEC}
        t0 = time.perf_counter()
        rbs = {name: ReplayBuffer.create(space, cache_path=str(d / name), capacity=n, compressor=c, overwrite=True)
               for name, c in comps.items()}
        for lo in range(0, n, 65536):
            x = vec_rows(min(65536, n - lo), lo)
            for rb in rbs.values():
                rb.extend(x)
        for rb in rbs.values():
            rb.close()
        print(f"vectors: built 3 stores of {n:,} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        names = list(comps)[k % 3:] + list(comps)[: k % 3]  # who opens and goes first rotates
        samplers, opened, opens = {}, {}, []
        for name in names:
            t0 = time.perf_counter()
            rb = ReplayBuffer.load_from(str(d / name), read_only=True)
            g = np.random.default_rng(n)
            samplers[name] = lambda rb=rb, g=g: rb.sample(256, rng=g)
            opened[name] = (time.perf_counter() - t0) * 1e3
            opens.append(rb)
        times = run_blocks(samplers, args.vector_calls, BLOCK, args.vector_budget)
        row = {"rows": n, "systems": {}}
        for name in comps:
            cold, steady, calls = phases(times[name])
            disk = sum(f.stat().st_size for f in (d / name).rglob("c/**/*") if f.is_file())
            row["systems"][name] = {"open_ms": opened[name], "cold_ms": cold, "steady_ms": steady, "calls": calls,
                                    "disk_bytes": disk}
        for rb in opens:  # spot check: the rows are right
            idx = np.arange(0, n, max(1, n // 37))
            want = np.stack([vec_rows(min(65536, n - (i // 65536) * 65536), (i // 65536) * 65536)[i % 65536] for i in idx])
            assert (rb[idx] == want).all()
            rb.close()
        s = row["systems"]
        for ph in ("cold", "steady"):
            for name, key in (("lz4", f"ratio_{ph}"), ("lz4-old", f"ratio_{ph}_before")):
                if s["raw"][f"{ph}_ms"] and s[name][f"{ph}_ms"]:
                    row[key] = s["raw"][f"{ph}_ms"] / s[name][f"{ph}_ms"]
        print(f"vectors {n:>11,}: " + "; ".join(f"{m} cold {v['cold_ms']:.3f} steady {v['steady_ms'] or 0:.3f} ms "
                                              f"({v['calls']} calls)" for m, v in s.items())
              + f"; lz4/raw rate steady x{row.get('ratio_steady', 0):.3f}", file=sys.stderr)
        out["sizes"].append(row)
        shutil.rmtree(d, ignore_errors=True)
    first, last = out["sizes"][0]["systems"], out["sizes"][-1]["systems"]
    for name in ("raw", "lz4", "lz4-old"):
        if first[name]["steady_ms"] and last[name]["steady_ms"]:
            out.setdefault("growth", {})[name] = last[name]["steady_ms"] / first[name]["steady_ms"]
    return out


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
    ap.add_argument("--vector-rows", default=None,
                    help="comma-separated (17,) float32 store sizes (default 1000000,10000000; quick 2000,20000; 0: none)")
    ap.add_argument("--vector-calls", type=int, default=None, help="sample(256) calls per system (default 600; quick 250)")
    ap.add_argument("--vector-budget", type=float, default=None, help="seconds per system per size (default 5; quick 1)")
    ap.add_argument("--no-images", action="store_true", help="vectors (and remote) only")
    ap.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder, removed)")
    args = ap.parse_args(argv)
    q = args.quick
    args.rows = args.rows or (2000 if q else 30000)
    args.remote_rows = args.remote_rows or (1200 if q else 6000)
    args.seconds = args.seconds or (0.2 if q else 2.0)
    args.remote_batches = args.remote_batches or (2 if q else 9)
    args.vector_rows = [int(x) for x in (args.vector_rows or ("2000,20000" if q else "1000000,10000000")).split(",")
                        if int(x) > 0]
    args.vector_calls = args.vector_calls or (250 if q else 600)
    args.vector_budget = args.vector_budget or (1.0 if q else 5.0)
    if q:  # small fields would otherwise be served from whole cached chunks (they fit the cache)
        chunked.ROW_READS_ABOVE_BYTES = 0
        chunked.SMALL_BLOCK_ROW_READS_ABOVE_BYTES = 0
    root = Path(tempfile.mkdtemp(prefix="bench_compressed_", dir=args.dir))
    try:
        res: dict = {"quick": q}
        if args.vector_rows:
            res["vectors"] = vectors(args, root)
        data = frames(max(args.rows, args.remote_rows))
        if not args.no_images:
            res.update(local(args, root, data[: args.rows]))
        if not args.no_remote:
            r = remote(args, data[: args.remote_rows])
            if r:
                res["remote"] = r
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res


def vector_table(v: dict) -> str:
    """The vector rows' table from :func:`vectors`' results."""
    lines = ["| rows | system | open ms | disk MB | cold ms/call | steady ms/call | calls | rate vs raw, cold / steady |",
             "|---|---|---|---|---|---|---|---|"]
    for row in v["sizes"]:
        raw = row["systems"]["raw"]
        for name, s in row["systems"].items():
            st = f"{s['steady_ms']:.3f}" if s["steady_ms"] is not None else "-"
            rs = f"{raw['steady_ms'] / s['steady_ms']:.3f}x" if s["steady_ms"] and raw["steady_ms"] else "-"
            lines.append(f"| {row['rows']:,} | {name} | {s['open_ms']:.1f} | {s['disk_bytes'] / 1e6:,.1f} | "
                         f"{s['cold_ms']:.3f} | {st} | {s['calls']} | {raw['cold_ms'] / s['cold_ms']:.3f}x / {rs} |")
    g = v.get("growth", {})
    if g and len(v["sizes"]) > 1:
        lo, hi = v["sizes"][0]["rows"], v["sizes"][-1]["rows"]
        lines += ["", f"Steady time per call at {hi:,} rows over {lo:,} rows (target for lz4 <= 1.3x): "
                  + ", ".join(f"{name} {x:.2f}x" for name, x in g.items()) + "."]
    return "\n".join(lines)


def table(res: dict) -> str:
    """The section's table from :func:`measure`'s results."""
    if "sample256" not in res:
        return vector_table(res["vectors"]) if "vectors" in res else ""
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
    vec = ""
    if "vectors" in res:
        vec = ("Vector rows: `sample(256)` of (17,) float32 rows (standard normal), `raw` vs `lz4` vs `lz4-old` (the "
               "previous lz4 layout of small rows: typesize 4, whose blocks c-blosc enlarges to 64 KiB, read by this "
               "code), each store freshly opened, no read before timing, blocks of 25 consecutive calls per system, "
               f"systems rotated; cold = the first {res['vectors']['cold_calls']} calls, steady = the calls after. "
               "Target: lz4 at >= 0.25x raw's rate, and lz4's steady time at the largest size <= 1.3x the smallest."
               "\n\n" + vector_table(res["vectors"]) + "\n\nImage rows: ")
    if "sample256" not in res:
        return section("Compressed image rows and remote batches (scripts/bench_compressed.py)", "bench_compressed.py",
                       argv, runs="vectors: blocks of consecutive calls (cold and steady reported apart)",
                       body=vec.removesuffix("\n\nImage rows: "), quick=q, started=started, packages=("s3fs", "moto"))
    body = vec + (f"{res['rows']:,} (64,64,3) uint8 rows, one process, page cache warm; \"before\" is the previous lz4 layout "
            "(c-blosc's own block size) read the previous way (whole chunks through zarr, 256 MiB decoded cache); "
            "remote: a moto S3 server on 127.0.0.1, cold batches of 256 (caches dropped). Each image row is its own "
            "blosc block inside ordinary zarr chunks (docs/format.md), so a random row decodes one row.\n\n"
            + table(res))
    return section("Compressed image rows and remote batches (scripts/bench_compressed.py)", "bench_compressed.py",
                   argv, runs=f"vectors: blocks of consecutive calls, cold and steady apart (means); local image "
                   f"rows/s: calls for {0.2 if q else 2.0:g} s after one warm-up call (a rate, not a median; no cold "
                   f"figure); remote: median of {2 if q else 9} cold batches.",
                   body=body, quick=q, started=started, packages=("s3fs", "moto"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    res = measure()
    if "vectors" in res and "sample256" in res:
        print(vector_table(res["vectors"]))
    print(table(res))
    print(json.dumps(res))
