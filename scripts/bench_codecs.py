"""Image codecs (issue 31): size on disk and random-read speed of image fields, against raw rows
and against the codec's own decode loop over the same frames.

Frames (each store holds ``--frames`` of them, default 20,000):

- natural photos: scikit-image's bundled ``astronaut``, ``coffee`` and ``chelsea`` when scikit-image
  is importable, else matplotlib's bundled ``grace_hopper.jpg`` (the table says which), as random
  crops (half to all of a photo), flips and resizes (Pillow, seeded) at 84x84x3 and 480x640x3; a
  pool of up to 2,000 distinct frames repeated to fill the store;
- gymnasium ``rgb_array`` renders (CartPole-v1 and Pendulum-v1 under random actions, resized to
  84x84x3 and 480x640x3) when their renderer (pygame) is importable, else the table says so.

Each store is a ``ReplayBuffer`` of one Box field, written by ``extend`` of 500 frames.  Reads are
``sample(256)`` (uniform random rows) in blocks of consecutive calls, one system at a time (as a
training loop calls; no warm-up batches): the store with 1 decode thread, then with 2
(``trajstore.images.set_decode_threads``), then the codec's own loop (the library the store decodes
with, one thread, decoding the same 256 frames (the same seeded draws) from the same shard files
into a preallocated array), then raw rows (a raw store of the same frames).  Each is opened fresh per run: "cold" is
the first block after opening (page cache warm; no batch memory recycled from the system before:
``trajstore.images.release_recycled_batches``), "steady" the median of the blocks after it; each
number is the median over ``--runs`` runs.  The DataLoader rows read a ``TransitionDataset`` of
the 480x640 JPEG store with 0 and 2 workers (fork), ``--loader-batch`` frames per batch.

    python scripts/bench_codecs.py                  # 20,000 frames per store (raw 480x640: 18 GB of disk)
    python scripts/bench_codecs.py --quick          # 128 frames, 1 run, small blocks (a smoke test, seconds)
    python scripts/bench_codecs.py --sizes 84       # the 84x84 rows only (no 480x640 stores)
    python scripts/bench_codecs.py --sources renders --frames 1000 --runs 3   # the gymnasium renders only
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
Row = dict[str, Any]
_DECODERS = {"jpeg": imagecodecs.jpeg8_decode, "png": imagecodecs.png_decode, "webp": imagecodecs.webp_decode,
             "avif": imagecodecs.avif_decode, "jpegxl": imagecodecs.jpegxl_decode}


# -- frames -------------------------------------------------------------------------------------
def photos() -> tuple[list[Any], str]:
    """The source photos (PIL images) and their name for the table."""
    from PIL import Image

    try:
        from skimage import data
    except ImportError:
        import matplotlib

        path = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        return [Image.open(path).convert("RGB")], "matplotlib's grace_hopper.jpg (scikit-image is not installed)"
    return ([Image.fromarray(f()) for f in (data.astronaut, data.coffee, data.chelsea)],
            "scikit-image's astronaut, coffee, chelsea")


def crops(pool: list[Any], n: int, shape: tuple[int, int, int], seed: int = 0) -> np.ndarray:
    """``n`` frames of ``shape`` cut from the PIL images ``pool``: random crops (half to all of an
    image), flips and bilinear resizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = np.empty((n, *shape), np.uint8)
    for i in range(n):
        img = pool[int(rng.integers(len(pool)))]
        w0, h0 = img.size
        s = rng.uniform(0.5, 1.0)
        w, h = int(w0 * s), int(h0 * s)
        x, y = int(rng.integers(0, w0 - w + 1)), int(rng.integers(0, h0 - h + 1))
        f = img.crop((x, y, x + w, y + h)).resize((shape[1], shape[0]), Image.BILINEAR)
        if rng.random() < 0.5:
            f = f.transpose(Image.FLIP_LEFT_RIGHT)
        out[i] = np.asarray(f)
    return out


def renders(n: int, shape: tuple[int, int, int]) -> tuple[np.ndarray | None, str]:
    """``n`` gymnasium ``rgb_array`` renders resized to ``shape`` (None and the reason where the
    renderer is not installed)."""
    from PIL import Image

    try:
        envs = [gym.make(e, render_mode="rgb_array") for e in ("CartPole-v1", "Pendulum-v1")]
        for i, env in enumerate(envs):
            env.reset(seed=i)
            env.render()
    except gym.error.DependencyNotInstalled as e:
        return None, f"gymnasium renders: not measured ({e})"
    out = np.empty((n, *shape), np.uint8)
    for i in range(n):
        env = envs[i % len(envs)]
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
        out[i] = np.asarray(Image.fromarray(env.render()).resize((shape[1], shape[0]), Image.BILINEAR))
    return out, "gymnasium CartPole-v1 and Pendulum-v1 rgb_array renders"


def cycled(pool: np.ndarray, n: int, block: int = 500) -> Iterator[np.ndarray]:
    """``n`` frames in blocks of ``block``, the pool repeated."""
    for lo in range(0, n, block):
        yield pool[np.arange(lo, min(lo + block, n)) % len(pool)]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR of uint8 frames ``a`` against ``b`` (same shape), in dB; inf when equal.  Squared errors
    are summed a few frames at a time (a float64 copy of 128 480x640 frames at once would be 0.9 GB);
    float64 sums of integer squares are exact far beyond these sizes."""
    sq = 0.0
    for lo in range(0, len(a), 8):
        d = (a[lo : lo + 8].astype(np.float64) - b[lo : lo + 8]).ravel()
        sq += float(np.dot(d, d))
    mse = sq / a.size
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def du(path: Path) -> int:
    """Bytes of disk the files under ``path`` take (``du``: allocated blocks)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def build(path: Path, pool: np.ndarray, n: int, codec: str) -> Row:
    """A store of ``n`` frames (``pool`` repeated) under ``codec``; its size and PSNR."""
    shape = pool.shape[1:]
    t0 = time.perf_counter()
    with ReplayBuffer.create(gym.spaces.Box(0, 255, shape, np.uint8), cache_path=str(path), capacity=n,
                             compressor=None if codec == "raw" else codec) as rb:
        for frames in cycled(pool, n):
            rb.extend(frames)
    row: Row = {"codec": codec, "frame": "x".join(map(str, shape)), "n": n, "write_s": time.perf_counter() - t0,
                "du": du(path), "raw_bytes": n * pool[0].nbytes}
    with ReplayBuffer.load_from(str(path), read_only=True) as ro:
        k = min(len(pool), n)
        row["psnr"] = _psnr(np.asarray(ro[0:k]), pool[:k])
    return row


# -- reads --------------------------------------------------------------------------------------
def _blocks(fn: Callable[[], Any], blocks: int, per_block: int) -> tuple[list[float], list[float]]:
    """Frames/s of each of ``blocks`` blocks of ``per_block`` consecutive calls of ``fn``, and the
    cores the process used meanwhile (its CPU time over the wall time: below the threads it ran,
    the machine did not give it more)."""
    fps, cores = [], []
    for _ in range(blocks):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(per_block):
            fn()
        wall = time.perf_counter() - t
        fps.append(BATCH * per_block / wall)
        cores.append((time.process_time() - c) / wall)
    return fps, cores


def own_decoder(fmt: str) -> Callable[[Any, np.ndarray], Any]:
    """The bare library call that the store decodes ``fmt`` with: simplejpeg for JPEG where it is
    installed (``trajstore.images.set_jpeg_decoder``'s default), else imagecodecs."""
    if fmt == "jpeg":
        try:
            import simplejpeg
        except ImportError:
            pass
        else:
            sj = simplejpeg.decode_jpeg
            return lambda b, out: sj(b, "rgb", False, False, 0, 0, 1.0, out, False)
    f = _DECODERS[fmt]
    return lambda b, out: f(b, out=out)


class OwnLoop:
    """The codec's own decode loop over a store's frames: each row's bytes located once in the
    memory-mapped shard files (untimed), then the library (:func:`own_decoder`) decoding them
    into one array."""

    def __init__(self, path: Path, codec: str) -> None:
        meta = json.loads((path / "step_data" / "zarr.json").read_text())
        self.shape = tuple(meta["shape"][1:])
        self.C = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
        self.maps, self.offsets, self.sizes = [], [], []
        for k in range(-(-meta["shape"][0] // self.C)):
            with open(path / "step_data" / "c" / str(k) / "0" / "0" / "0", "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            o, s = read_index(np.frombuffer(m, np.uint8), self.C)
            self.maps.append(memoryview(m))
            self.offsets.append(o)
            self.sizes.append(s)
        self.dec = own_decoder(codec.split(":")[0].split("-")[0])
        self.out = np.empty((BATCH, *self.shape), np.uint8)

    def call(self, rows: np.ndarray) -> np.ndarray:
        dec, out, C = self.dec, self.out, self.C
        for i, r in enumerate(rows.tolist()):
            k, j = divmod(r, C)
            o = int(self.offsets[k][j])
            dec(self.maps[k][o : o + int(self.sizes[k][j])], out[i])
        return out

    def close(self) -> None:
        for m in self.maps:
            m.release()


def reads(path: Path, raw: Path, n: int, codec: str, runs: int, blocks: int, per_block: int) -> Row:
    """Cold and steady frames/s (medians over ``runs``) of sample(256) through the store with 1 and 2
    decode threads, the codec's own loop over the same rows, and raw rows."""
    got: dict[str, list[list[float]]] = {}
    used: list[list[float]] = []  # cores used by the store's 2-thread blocks, per run
    for run in range(runs):
        for name in ("store1", "store2", "own", "raw"):
            seed = 1000 + run
            ti.release_recycled_batches()  # (each system starts cold: no batch memory recycled from the one before)
            if name == "own":
                if codec == "raw":
                    continue
                own, g = OwnLoop(path, codec), np.random.default_rng(seed)
                fps, _ = _blocks(lambda: own.call(g.integers(0, n, size=BATCH)), blocks, per_block)
                own.close()
            else:
                ti.set_decode_threads(2 if name == "store2" else 1)
                with ReplayBuffer.load_from(str(raw if name == "raw" else path), read_only=True) as ro:
                    g = np.random.default_rng(seed)
                    fps, cores = _blocks(lambda: ro.sample(BATCH, rng=g), blocks, per_block)
                if name == "store2":
                    used.append(cores)
            got.setdefault(name, []).append(fps)
    ti.set_decode_threads(None)
    row: Row = {}
    for name, per_run in got.items():
        row[f"{name}_cold"] = statistics.median(f[0] for f in per_run)
        row[f"{name}_steady"] = statistics.median(statistics.median(f[1:]) for f in per_run)
    row["cores_cold"] = statistics.median(c[0] for c in used)
    row["cores_steady"] = statistics.median(statistics.median(c[1:]) for c in used)
    return row


def loader(path: Path, workers: int, batch: int, batches: int) -> Row:
    """Samples/s of a DataLoader over the store's TransitionDataset: the first batch (workers
    starting, cold) and the batches after it."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from trajstore.torch.datasets import TransitionDataset

    ds = TransitionDataset(str(path), output="torch")
    sampler = RandomSampler(ds, replacement=True, num_samples=batch * (batches + 1),
                            generator=torch.Generator().manual_seed(0))
    dl = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                    multiprocessing_context="fork" if workers else None, persistent_workers=False)
    t0 = time.perf_counter()
    it = iter(dl)
    next(it)
    t1 = time.perf_counter()
    k = sum(1 for _ in it)
    t2 = time.perf_counter()
    ds.close()
    return {"workers": workers, "cold": batch / (t1 - t0), "steady": batch * k / (t2 - t1)}


def _loader_child(path: Path, workers: int, threads: int, batch: int, batches: int, out: Path) -> None:
    ti.set_decode_threads(threads or None)  # (0: the default; forked workers inherit the setting)
    out.write_text(json.dumps(loader(path, workers, batch, batches)))


def loaders(path: Path, batch: int, batches: int, runs: int) -> list[Row]:
    """:func:`loader` with 0 and 2 workers, with the default decode threads and with 1 decode thread
    per process; each run in a fresh interpreter (a forked worker then inherits only that run's
    state); medians over ``runs``."""
    rows = []
    for threads in (0, 1):
        for workers in (0, 2):
            got = []
            for _ in range(runs):
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    subprocess.run([sys.executable, __file__, "--loader-child", str(path), str(workers), str(threads),
                                    str(batch), str(batches), f.name], check=True)
                    got.append(json.loads(Path(f.name).read_text()))
            rows.append({"workers": workers, "threads": threads,
                         **{k: statistics.median(g[k] for g in got) for k in ("cold", "steady")}})
    return rows


# -- report -------------------------------------------------------------------------------------
def _ok(value: float, target: float) -> str:
    return f"{value:.2f} ({'ok' if value >= target else 'MISSED'}, >= {target})"


def size_table(rows: list[Row]) -> str:
    lines = ["| frames | frame | codec | store frames | `du` bytes | raw / store (`du`) | PSNR dB | write s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['frame']} | {r['codec']} | {r['n']:,} | {r['du']:,} | "
                     f"{r['raw_bytes'] / r['du']:.1f}x | "
                     f"{'exact' if r['psnr'] == float('inf') else format(r['psnr'], '.1f')} | {r['write_s']:.1f} |")
    return "\n".join(lines)


def read_table(rows: list[Row]) -> str:
    lines = ["| frames | frame | codec | phase | raw frames/s (1 core) | store 1 thread | store 2 threads | "
             "per core, 2 threads | cores used, 2 threads | 2 vs 1 thread | codec's own loop | store 1 thread / own |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["codec"] == "raw":
            continue
        for ph in ("cold", "steady"):
            s1, s2, own, raw = r[f"store1_{ph}"], r[f"store2_{ph}"], r[f"own_{ph}"], r[f"raw_{ph}"]
            lines.append(f"| {r['source']} | {r['frame']} | {r['codec']} | {ph} | {raw:,.0f} | {s1:,.0f} | {s2:,.0f} | "
                         f"{s2 / 2:,.0f} | {r[f'cores_{ph}']:.2f} | {_ok(s2 / s1, 1.6)} | {own:,.0f} | "
                         f"{_ok(s1 / own, 0.8)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; the markdown section for docs/benchmarks.md (also printed)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 frames, 1 run, small blocks (a smoke test, seconds)")
    ap.add_argument("--frames", type=int, default=None, help="frames per store (default 20,000)")
    ap.add_argument("--runs", type=int, default=None, help="runs per read measurement (default 5)")
    ap.add_argument("--codecs", default="jpeg:90,png,webp-lossless", help="comma-separated, 84x84 (plus raw)")
    ap.add_argument("--big-codecs", default="jpeg:90", help="comma-separated, 480x640 (plus raw; lossless ones "
                    "encode at 0.1-0.2 s a frame there)")
    ap.add_argument("--loader-batch", type=int, default=32, help="DataLoader batch size (480x640 frames)")
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default a temp folder)")
    ap.add_argument("--sources", default="photos,renders", help="comma-separated frame sources to run: photos "
                    "and/or renders (the gymnasium renders, where their renderer is importable)")
    ap.add_argument("--sizes", default="84,480", help="frame sizes to run: 84 (84x84x3) and/or 480 (480x640x3; "
                    "its raw store takes 0.92 MB a frame of disk)")
    a = ap.parse_args(argv)
    n = a.frames or (128 if a.quick else 20_000)
    runs = a.runs or (1 if a.quick else 5)
    blocks, per_block = (3, 2) if a.quick else (6, 10)
    loader_batches = 2 if a.quick else 40
    pool, source = photos()
    sources: list[tuple[str, str, Callable[[tuple[int, int, int]], np.ndarray | None]]] = [
        ("photos", source, lambda shape: crops(pool, min(n, 2000), shape))]
    render_note = renders(1, (84, 84, 3))[1]
    if not render_note.startswith("gymnasium renders: not"):
        sources.append(("renders", render_note, lambda shape: renders(min(n, 2000), shape)[0]))
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    sizes, reads_rows, loader_rows = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_codecs_", dir=a.dir) as d:
        tmp = Path(d)
        for label, _, make in sources:
            if label not in a.sources.split(","):
                continue
            for shape, codecs in (((84, 84, 3), a.codecs), ((480, 640, 3), a.big_codecs)):
                if str(shape[0]) not in a.sizes.split(","):
                    continue
                frames = make(shape)
                assert frames is not None
                raw = tmp / f"{label}_{shape[0]}_raw"
                for codec in ["raw", *codecs.split(",")]:
                    path = raw if codec == "raw" else tmp / f"{label}_{shape[0]}_{codec.replace(':', '_')}"
                    row = {"source": label, **build(path, frames, n, codec)}
                    sizes.append(row)
                    print(size_table([row]).splitlines()[-1], flush=True)
                    if codec != "raw":
                        row.update(reads(path, raw, n, codec, runs, blocks, per_block))
                        reads_rows.append(row)
                        print(read_table([row]).splitlines()[-1], flush=True)
                    if label == "photos" and shape[0] == 480 and codec.startswith("jpeg"):
                        loader_rows = loaders(path, a.loader_batch, loader_batches, runs)
                    if codec != "raw":
                        _drop(path)
                _drop(raw)
    took = time.perf_counter() - t0
    big = next((r for r in sizes if r["frame"] == "480x640x3" and r["codec"].startswith("jpeg")), None)
    lines = [
        "Frames: " + "; ".join([note for label, note, _ in sources if label in a.sources.split(",")]
                               + ([] if len(sources) > 1 else [render_note])) + f". {n:,} frames per store "
        f"(a pool of {min(n, 2000):,} distinct frames repeated). Reads: `sample({BATCH})`, {blocks} blocks of "
        f"{per_block} consecutive calls per system and run, one system at a time, no warm-up; cold = the first block "
        f"after opening (page cache warm, no batch memory recycled from the system before), steady = the median of the other blocks; medians over {runs} run(s). "
        f"{time.strftime('%Y-%m-%d')}, imagecodecs {imagecodecs.__version__}, {os.cpu_count()} cores, took "
        f"{took:.0f} s; load average {load0:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (a machine "
        "shared with other jobs: frames/s are those of the CPU time this process got).",
        "", size_table(sizes), ""]
    if big is not None:
        lines += [f"Disk, {big['n']:,} frames of 480x640x3 as {big['codec']}: {big['du']:,} bytes against the raw "
                  f"store's {next(r['du'] for r in sizes if r['frame'] == '480x640x3' and r['codec'] == 'raw'):,} "
                  f"(target <= 1/10: {'ok' if big['raw_bytes'] / big['du'] >= 10 else 'MISSED'}).", ""]
    lines += ["Frames/s of `sample(256)`; \"per core\": the 2-thread frames/s over 2 cores; \"cores used\": the "
              "process's CPU time over the wall time of those blocks (under 2, other jobs had the rest of the "
              "machine, and \"2 vs 1\" cannot reach 2); \"codec's own loop\": the library the store decodes with "
              "(simplejpeg for JPEG where installed, else imagecodecs) decoding the same frames "
              "(same draws) from the same shard files, one thread.", "",
              read_table(reads_rows)]
    if loader_rows:
        lines += ["", f"DataLoader over the 480x640 JPEG store (`TransitionDataset`, batches of {a.loader_batch}, "
                  f"{loader_batches} batches after the first, fork; medians over {runs} run(s), each in a fresh "
                  "interpreter). Default decode threads: a process with 0 workers decodes on every core, each "
                  "of n workers on max(1, cores // n) (`trajstore.images.share_decode_threads`); the target "
                  "(>= 1.5x) is against the default 0-worker row, what a user gets. With 1 decode thread per "
                  "process (`set_decode_threads(1)`) the workers are what adds cores:", "",
                  "| decode threads per process | workers | first batch samples/s | samples/s after it | vs 0 workers |",
                  "|---|---|---|---|---|"]
        for r in loader_rows:
            base = next(z for z in loader_rows if z["threads"] == r["threads"] and z["workers"] == 0)
            vs = "1.00" if r["workers"] == 0 else _ok(r["steady"] / base["steady"], 1.5)
            lines.append(f"| {'default' if r['threads'] == 0 else r['threads']} | {r['workers']} | {r['cold']:,.0f} | "
                         f"{r['steady']:,.0f} | {vs} |")
    return section(HEADING[3:], "bench_codecs.py", sys.argv[1:] if argv is None else argv,
                   runs=f"medians over {runs} run(s) of {blocks} blocks per system.", body="\n".join(lines),
                   quick=a.quick, started=t0, packages=("imagecodecs", "simplejpeg"))


def _drop(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loader-child"]:
        p, w, t, b, k, o = sys.argv[2:8]
        _loader_child(Path(p), int(w), int(t), int(b), int(k), Path(o))
    else:
        print(main())
