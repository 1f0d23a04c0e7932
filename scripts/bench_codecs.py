"""Image codecs (issue 31): size on disk and random-read speed of image fields, against raw rows
and against the codec's own decode loop over the same frames.

Frames: natural photos (matplotlib's bundled ``grace_hopper.jpg``, 512x600: random crops, flips
and resizes with Pillow, seeded) at 84x84x3 and 480x640x3.  For each codec a store of the frames
is written (``ReplayBuffer``, one Box field), then read by random ``rb[idx]`` batches of 256 rows:

- size: the field's chunk files (``du``-like: bytes of the files) against the raw frames' bytes;
- PSNR (lossy codecs) over every frame of the store;
- frames/s through the store with 1 and 2 decode threads (``trajstore.images.set_decode_threads``),
  and the codec's own loop (imagecodecs, one thread, decoding into a preallocated array) over the
  encoded bytes of the same 256 frames; raw rows (memory-mapped) for scale.

Medians over ``--calls`` batches after 3 warm-up batches, page cache warm.

    python scripts/bench_codecs.py                  # 20,000 frames at 84x84, 2,000 at 480x640 (JPEG)
    python scripts/bench_codecs.py --quick          # 2,000 / 300 frames (smoke test)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gymnasium as gym
import imagecodecs
from benchdoc import section

import trajstore.images as ti
from trajstore import ReplayBuffer
from trajstore.storage.fields.image import read_index

BATCH = 256
HEADING = "## Image codecs: size and random reads (bench_codecs.py)"


def natural_frames(n: int, shape: tuple[int, int, int], seed: int = 0) -> np.ndarray:
    """``n`` frames cut from a photo: random crops (a quarter to all of it), flips and resizes."""
    import matplotlib
    from PIL import Image

    photo = Image.open(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg").convert("RGB")
    rng = np.random.default_rng(seed)
    w0, h0 = photo.size
    out = np.empty((n, *shape), np.uint8)
    for i in range(n):
        s = rng.uniform(0.5, 1.0)
        w, h = int(w0 * s), int(h0 * s)
        x, y = int(rng.integers(0, w0 - w + 1)), int(rng.integers(0, h0 - h + 1))
        img = photo.crop((x, y, x + w, y + h)).resize((shape[1], shape[0]), Image.BILINEAR)
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(img)
    return out


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _median_fps(fn: Any, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return BATCH / statistics.median(times)


def _encoded(path: Path, idx: np.ndarray, chunk_rows: int) -> list[bytes]:
    """The stored (encoded) bytes of rows ``idx``, read from the shard files."""
    out = []
    for r in idx.tolist():
        k = r // chunk_rows
        f = next((path / "step_data" / "c").glob(f"{k}/**/*"))
        while f.is_dir():
            f = next(f.iterdir())
        buf = np.fromfile(f, np.uint8)
        off, size = (a[r - k * chunk_rows] for a in read_index(buf, chunk_rows))
        out.append(buf[off : off + size].tobytes())
    return out


_DECODERS = {"jpeg": imagecodecs.jpeg8_decode, "png": imagecodecs.png_decode, "webp": imagecodecs.webp_decode,
             "avif": imagecodecs.avif_decode, "jpegxl": imagecodecs.jpegxl_decode}


def bench_one(tmp: Path, frames: np.ndarray, codec: str, calls: int) -> dict[str, Any]:
    n, shape = len(frames), frames.shape[1:]
    path = tmp / f"{shape[0]}_{codec.replace(':', '_')}"
    t0 = time.perf_counter()
    rb = ReplayBuffer.create(gym.spaces.Box(0, 255, shape, np.uint8), cache_path=str(path), capacity=n,
                             compressor=None if codec == "raw" else codec)
    for lo in range(0, n, 500):
        rb.extend(frames[lo : lo + 500])
    rb.close()
    write_s = time.perf_counter() - t0
    files = [p for p in (path / "step_data").rglob("*") if p.is_file() and p.name != "zarr.json"]
    disk = sum(p.stat().st_size for p in files)
    rng = np.random.default_rng(1)
    ro = ReplayBuffer.load_from(str(path), read_only=True)
    row: dict[str, Any] = {"codec": codec, "frame": "x".join(map(str, shape)), "n": n,
                           "ratio": frames.nbytes / disk, "write_s": write_s}
    got = np.concatenate([ro[lo : min(lo + 1000, n)] for lo in range(0, n, 1000)])
    row["psnr"] = _psnr(got, frames)
    batches = [rng.integers(0, n, BATCH) for _ in range(8)]
    it = iter(range(10**9))
    for threads in (1, 2):
        ti.set_decode_threads(threads)
        row[f"fps{threads}"] = _median_fps(lambda: ro[batches[next(it) % 8]], calls)
    ti.set_decode_threads(None)
    if codec != "raw":
        chunk_rows = ro._store.tables["step_data"].fields[0].C  # (the field's shard rows)
        blobs = _encoded(path, batches[0], chunk_rows)
        dec = _DECODERS[codec.split(":")[0].split("-")[0]]
        out = np.empty((BATCH, *shape), np.uint8)

        def own() -> None:
            for i, b in enumerate(blobs):
                dec(b, out=out[i])

        row["own"] = _median_fps(own, calls)
    ro.close()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [("| frame | codec | frames | size vs raw | PSNR dB | write s | store 1 thread frames/s | "
              "store 2 threads frames/s | 2 vs 1 | codec's own loop frames/s | store / own |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own = r.get("own")
        lines.append(
            f"| {r['frame']} | {r['codec']} | {r['n']:,} | {r['ratio']:.1f}x | "
            f"{'exact' if r['psnr'] == float('inf') else format(r['psnr'], '.1f')} | {r['write_s']:.1f} | "
            f"{r['fps1']:,.0f} | {r['fps2']:,.0f} | {r['fps2'] / r['fps1']:.2f} | "
            f"{'-' if own is None else format(own, ',.0f')} | {'-' if own is None else format(r['fps1'] / own, '.2f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,000 / 300 frames, 10 calls (smoke test)")
    ap.add_argument("--calls", type=int, default=None, help="timed batches per measurement (default 30)")
    ap.add_argument("--codecs", default="jpeg:90,png,webp-lossless", help="comma-separated, 84x84 (plus raw)")
    ap.add_argument("--big-codecs", default="jpeg:90", help="comma-separated, 480x640 (plus raw; lossless ones "
                    "encode at 0.1-0.2 s a frame there)")
    a = ap.parse_args(argv)
    calls = a.calls or (10 if a.quick else 30)
    sizes = [((84, 84, 3), 2000 if a.quick else 20_000, a.codecs),
             ((480, 640, 3), 300 if a.quick else 2000, a.big_codecs)]
    rows = []
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_codecs_") as d:
        for shape, n, codecs in sizes:
            frames = natural_frames(n, shape)
            for codec in ["raw", *codecs.split(",")]:
                rows.append(bench_one(Path(d), frames, codec, calls))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    took = time.perf_counter() - t0
    text = (f"Random `rb[idx]` batches of {BATCH} frames, median of {calls} batches after 3 warm-up ones, page "
            f"cache warm; frames cut from a photo (matplotlib's grace_hopper.jpg); {time.strftime('%Y-%m-%d')}, "
            f"imagecodecs {imagecodecs.__version__}, took {took:.0f} s, one run; load average {load0:.1f} at the "
            f"start and {os.getloadavg()[0]:.1f} at the end (on a machine shared with other jobs, absolute "
            "frames/s and the thread ratios are those of the CPU time this process got). \"2 vs 1\": store frames/s with 2 decode "
            "threads over 1; \"store / own\": the store's 1-thread frames/s over imagecodecs' own loop decoding "
            "the same 256 encoded frames into a preallocated array.\n\n" + table(rows))
    return section(HEADING[3:], "bench_codecs.py", argv, runs=f"median of {calls} batches per row, one run.",
                   body=text, quick=a.quick, started=started, packages=("imagecodecs",))


if __name__ == "__main__":
    print(main())
