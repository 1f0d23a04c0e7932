"""Offline-dataset benchmark: DataLoader throughput (samples/s) of trajstore.torch datasets, random
batches of 256 transitions and of 256 x 32-step sequences, with 0, 2 and 4 worker processes, on a
local store, against a numpy in-RAM gather of the same batches; workers against no workers for raw
vector rows, raw image rows and lz4 / zstd / JPEG image rows (cold: from a fresh DataLoader, worker start-up
included; steady: blocks of consecutive batches after that), and the cost of moving one batch
through the worker queue; and S3 requests per batch against a moto server on 127.0.0.1 (needs
moto[server] and s3fs; skipped without them).

    python scripts/bench_offline.py                          # 1M-row store
    python scripts/bench_offline.py --quick                  # 50k rows, fewer batches (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MotoS3, _median_time
from benchdoc import section

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.torch import (
    ChunkShuffleSampler,
    RandomBatchSampler,
    SampleBatch,
    SequenceDataset,
    TransitionDataset,
    collate_batch,
)
from trajstore.torch._transfer import in_worker, pack

B, T = 256, 32
FIELDS = ["obs", "action", "reward"]
SPACE = gym.spaces.Dict({
    "obs": gym.spaces.Box(-np.inf, np.inf, (17,), np.float32),
    "action": gym.spaces.Box(-1, 1, (6,), np.float32),
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32),
})
warnings.filterwarnings("ignore", message="This DataLoader will create")
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request log lines


def make_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"obs": rng.standard_normal((rows, 17), dtype=np.float32),
            "action": rng.uniform(-1, 1, (rows, 6)).astype(np.float32),
            "reward": rng.standard_normal(rows, dtype=np.float32)}


def build(path: str, data: dict[str, np.ndarray], episode: int = 500, **kwargs) -> None:
    rows = len(data["reward"])
    with TrajectoryReplayBuffer.create(SPACE, cache_path=path, overwrite=True, **kwargs) as tb:
        block = max(episode, (1 << 16) // episode * episode)
        for lo in range(0, rows, block):
            hi = min(lo + block, rows)
            ids = (np.arange(lo, hi) // episode).astype(np.int64)
            tb.extend({"step_data": {k: v[lo:hi] for k, v in data.items()}, "episode_ids": ids})


IMG = (84, 84, 4)
IMAGE_SPACE = gym.spaces.Dict({"obs": gym.spaces.Box(0, 255, IMG, np.uint8), "action": gym.spaces.Discrete(18),
                               "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32)})


def build_images(path: str, rows: int, **kwargs) -> None:
    """Atari-like frames: a dark background with a few noisy bands (lz4 shrinks them about 3x)."""
    rng = np.random.default_rng(1)
    with ReplayBuffer.create(IMAGE_SPACE, cache_path=path, overwrite=True, **kwargs) as rb:
        for lo in range(0, rows, 1024):
            n = min(1024, rows - lo)
            obs = np.zeros((n, *IMG), np.uint8)
            obs[:, 10:40] = rng.integers(0, 255, (n, 30, *IMG[1:]), dtype=np.uint8)
            obs[:, 60:70] = 142
            rb.extend({"obs": obs, "action": rng.integers(0, 18, n), "reward": rng.standard_normal(n, dtype=np.float32)})


def workers_rates(ds, workers: int, cold: int, blocks: int, block: int, plain: bool = False,
                  batch: int = B) -> tuple[float, float]:
    """(cold, steady) samples/s of a fresh DataLoader: cold over its first ``cold`` batches, start-up
    of the workers included; steady the median over ``blocks`` blocks of ``block`` consecutive batches."""
    n = cold + blocks * block
    if plain:  # the documented plain usage: default collate, shuffled epoch
        loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True)
    else:
        loader = DataLoader(ds, batch_sampler=RandomBatchSampler(ds, batch, num_batches=n, seed=workers),
                            num_workers=workers, collate_fn=collate_batch)
    t0 = time.perf_counter()
    it = iter(loader)
    stamps = []
    for _ in range(n):
        next(it)
        stamps.append(time.perf_counter())
    del it
    steady = [block * batch / (stamps[cold + (k + 1) * block - 1] - stamps[cold + k * block - 1]) for k in range(blocks)]
    return cold * batch / (stamps[cold - 1] - t0), float(np.median(steady))


class _OneBatch(torch.utils.data.Dataset):
    """Hands out the same prepared batch (no reading): what is left is moving it to the loop."""

    def __init__(self, batch: dict[str, np.ndarray]) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return 1 << 30

    def __getitems__(self, idx):
        data = pack(self.batch) if in_worker() else {k: torch.from_numpy(v.copy()) for k, v in self.batch.items()}
        return SampleBatch(data, len(idx))


IMG_B = 64  # frames per batch in the workers table (vector rows: B)


def workers_table(d: str, data: dict[str, np.ndarray], quick: bool) -> str:
    vec = os.path.join(d, "vectors")
    build(vec, data)
    img_rows = 2_000 if quick else 12_000  # 12k frames: 340 MB, more than the 256 MB decoded-chunk cache
    codecs = {"raw": None, "lz4": "lz4", "zstd": "zstd", "jpeg": {"obs": "jpeg:90"}}
    stores = {c: os.path.join(d, f"images_{c}") for c in codecs}
    for c, comp in codecs.items():
        build_images(stores[c], img_rows, **({} if comp is None else {"compressor": comp}))
    cold, blocks, block = (5, 3, 10) if quick else (20, 7, 30)
    runs = 1 if quick else 3
    head = (f"| rows | batch | loader | workers | cold samples/s (first {cold} batches, start-up included) "
            f"| steady samples/s (median of {blocks} blocks of {block}) | steady vs 0 workers |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    sampler = "`RandomBatchSampler` + `collate_batch`"
    configs = [("raw (17,)+(6,)+() f32", vec, FIELDS, False, B), ("raw (17,)+(6,)+() f32", vec, FIELDS, True, B),
               ("raw (84,84,4) u8", stores["raw"], None, False, IMG_B),
               ("lz4 (84,84,4) u8", stores["lz4"], None, False, IMG_B),
               ("zstd (84,84,4) u8", stores["zstd"], None, False, IMG_B),
               ("jpeg:90 per frame (84,84,4) u8", stores["jpeg"], None, False, IMG_B)]
    load0 = os.getloadavg()[0]
    for name, path, fields, plain, batch in configs:
        ds = TransitionDataset(path, fields)
        got: dict[int, list[tuple[float, float]]] = {0: [], 2: []}
        for _ in range(runs):  # 0 and 2 workers in turn: both see the same load
            for workers in (0, 2):
                got[workers].append(workers_rates(ds, workers, cold, blocks, block, plain, batch))
        base = float(np.median([st for _, st in got[0]]))
        for workers in (0, 2):
            c, st = (float(np.median([r[k] for r in got[workers]])) for k in (0, 1))
            how = f"`batch_size={batch}, shuffle=True` (default collate)" if plain else sampler
            lines.append(f"| {name} | {batch} | {how} | {workers} | {c:,.0f} | {st:,.0f} | {st / base:.2f}x |")
        ds.close()
    lines += ["", f"Medians over {runs} run(s) per row (0 and 2 workers in turn); load average "
              f"{load0:.1f} before the first row, {os.getloadavg()[0]:.1f} after the last (2 cores shared "
              "with other jobs: ratios are indicative). Default decode threads: 0 workers decode frames on every "
              "CPU, each of n workers on max(1, CPUs // n) (trajstore.images.share_decode_threads)."]
    # The floor: a batch prepared in advance, only moved from a worker to the loop (a 4-byte batch:
    # what the DataLoader's own round trip of a batch costs, whatever the batch holds).
    floor = ["", "| batch of 256 | ms per batch, 0 workers (copy only) | ms per batch, 2 workers (moved through the queue) |",
             "|---|---|---|"]
    rng = np.random.default_rng(0)
    for name, batch in (("() f32, one value (4 bytes: the DataLoader's round trip alone)", {"reward": np.zeros(1, np.float32)}),
                        ("(17,)+(6,)+() f32 (24 KiB, shared memory copied out)", {k: v[:B].copy() for k, v in data.items()}),
                        ("(84,84,4) u8 (7 MiB, shared memory)",
                         {"obs": rng.integers(0, 255, (B, *IMG), dtype=np.uint8), "reward": np.zeros(B, np.float32)})):
            ms = [1e3 * B / workers_rates(_OneBatch(batch), w, cold, blocks, block)[1] for w in (0, 2)]
            floor.append(f"| {name} | {ms[0]:.3f} | {ms[1]:.3f} |")
    return "\n".join(lines + floor) + "\n"


def numpy_rate(data: dict[str, np.ndarray], seq: bool, repeats: int) -> float:
    """Samples/s of the same batches gathered from numpy arrays in RAM (as torch tensors)."""
    rng = np.random.default_rng(0)
    n = len(data["reward"])
    offs = np.arange(T)

    def one() -> None:
        idx = rng.integers(0, n, B)
        rows = np.minimum(idx[:, None] + offs, n - 1) if seq else idx
        {k: torch.from_numpy(v[rows]) for k, v in data.items()}

    return B / _median_time(one, repeats, 20)


def count_server_requests(server: MotoS3) -> list[int]:
    """A counter of the HTTP requests the moto server serves (DataLoader workers' included): its
    werkzeug app, wrapped."""
    wsgi = server._server._server  # moto's ThreadedMotoServer -> werkzeug server
    app, count, lock = wsgi.app, [0], threading.Lock()

    def counting(environ, start_response):
        with lock:
            count[0] += 1
        return app(environ, start_response)

    wsgi.app = counting
    return count


def s3_loader_rows(url: str, opts: dict, count: list[int], batches: int, cold: int, cache_dir: str) -> list[str]:
    """Rows of the S3 DataLoader table: requests per batch and samples/s of uniformly random
    batches (``RandomBatchSampler``) against ``ChunkShuffleSampler``, each from a fresh dataset
    (nothing cached), with and without the local chunk cache (``trajstore_chunk_cache``)."""
    rows: list[str] = []
    cached = {**opts, "trajstore_chunk_cache": cache_dir}

    def run(label: str, options: dict, chunked: bool, workers: int, n: int, drop: bool = False) -> None:
        ds = TransitionDataset(url, FIELDS, storage_options=options)
        sampler = (ChunkShuffleSampler(ds, B, num_workers=workers, seed=0) if chunked
                   else RandomBatchSampler(ds, B, num_batches=n, seed=0))
        before, got = count[0], 0
        t0 = time.perf_counter()
        if drop:  # a store much bigger than the decoded-chunk cache: every batch starts cold
            for idx in itertools.islice(sampler, n):
                for f in ds.buffer._table.fields:
                    f.drop_cache()
                ds.__getitems__(idx)
                got += 1
        else:
            loader = DataLoader(ds, batch_sampler=sampler, num_workers=workers, collate_fn=collate_batch)
            for _batch in itertools.islice(loader, n):
                got += 1
            del loader
        secs = time.perf_counter() - t0
        rows.append(f"| {label} | {workers} | {got} | {(count[0] - before) / got:.1f} | {got * B / secs:,.0f} |")
        ds.close()

    run("`RandomBatchSampler`, cold batches (chunk cache dropped before each)", opts, False, 0, cold, drop=True)
    run("`RandomBatchSampler`, fresh dataset (the store fits the decoded-chunk cache after a few batches)",
        opts, False, 0, batches)
    run("`ChunkShuffleSampler` (`pool_chunks=4`)", opts, True, 0, batches)
    run("`ChunkShuffleSampler` (`pool_chunks=4`)", opts, True, 2, batches)
    run("`RandomBatchSampler` + local chunk cache, empty folder", cached, False, 0, batches)
    run("`RandomBatchSampler` + local chunk cache, warm folder", cached, False, 0, batches)
    run("`ChunkShuffleSampler` + local chunk cache, warm folder", cached, True, 2, batches)
    return rows


def s3_requests(data: dict[str, np.ndarray], batches: int, loader_batches: int = 0,
                cold: int = 0) -> tuple[list[str], list[str]] | None:
    """Rows of the S3 tables (moto on 127.0.0.1): requests per batch for transitions and sequences;
    then (``loader_batches`` > 0) DataLoader rows of :func:`s3_loader_rows`."""
    try:
        import s3fs

        server = MotoS3()
        opts = server.options
    except ImportError:
        return None
    count = count_server_requests(server)
    try:
        url = f"s3://bench/{uuid.uuid4().hex}"
        build(url, data, storage_options=opts, chunk_rows=1024)
        calls: list[str] = []
        orig = s3fs.S3FileSystem._call_s3

        async def counting(fs, method, *args, **kwargs):
            calls.append(kwargs.get("Key", ""))
            return await orig(fs, method, *args, **kwargs)

        s3fs.S3FileSystem._call_s3 = counting
        rows = []
        try:
            for name, ds in (("transitions", TransitionDataset(url, FIELDS, storage_options=opts)),
                             (f"sequences x{T}", SequenceDataset(url, T, FIELDS, storage_options=opts))):
                buf = ds.buffer
                C = buf._table.fields[0].C
                per, chunks, secs = [], [], []
                rng = np.random.default_rng(1)
                for _ in range(batches):
                    for f in buf._table.fields:
                        f.drop_cache()  # a cold batch: nothing cached from the previous one
                    idx = rng.integers(0, len(ds), B)
                    anchors = ds.anchors[idx] if isinstance(ds, SequenceDataset) else idx
                    touched = np.unique(((anchors[:, None] + (np.arange(T) if isinstance(ds, SequenceDataset) else 0))
                                         .clip(0, len(buf) - 1)) // C)
                    calls.clear()
                    t = time.perf_counter()
                    ds.__getitems__(idx)
                    secs.append(time.perf_counter() - t)
                    per.append(len(calls))
                    # sequences also read the step episode ids (which frames belong to the episode)
                    chunks.append(len(touched) * (len(FIELDS) + isinstance(ds, SequenceDataset)))
                rows.append(f"| {name} | {np.mean(per):.1f} | {np.mean(chunks):.1f} | {np.median(secs) * 1e3:.1f} |")
        finally:
            s3fs.S3FileSystem._call_s3 = orig
        loader = []
        if loader_batches:
            with tempfile.TemporaryDirectory() as cache_dir:
                loader = s3_loader_rows(url, opts, count, loader_batches, cold, cache_dir)
        return rows, loader
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small store, few batches")
    ap.add_argument("--dir", default=None, help="where to put the temporary store")
    args = ap.parse_args(argv)
    rows = 50_000 if args.quick else 1_000_000
    cold, blocks, block = (5, 3, 10) if args.quick else (20, 7, 30)
    repeats = 5 if args.quick else 9
    data = make_data(rows)
    lines = [f"| items | workers | trajstore cold samples/s (first {cold} batches, start-up included) | trajstore "
             f"steady samples/s (median of {blocks} blocks of {block}) | numpy in-RAM samples/s | steady vs numpy |",
             "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "offline")
        build(path, data)
        for name, ds, seq in (("transitions", TransitionDataset(path, FIELDS), False),
                              (f"sequences x{T}", SequenceDataset(path, T, FIELDS), True)):
            base = numpy_rate(data, seq, repeats)
            for label, workers, output in ((name, 0, None), (name, 2, None), (name, 4, None),
                                           (f'{name}, output="numpy"', 4, "numpy")):
                if output is not None:  # numpy batches travel between processes as pickles, tensors in shared memory
                    ds.output = output
                c, st = workers_rates(ds, workers, cold, blocks, block)
                lines.append(f"| {label} | {workers} | {c:,.0f} | {st:,.0f} | {base:,.0f} | {base / st:.2f}x slower |")
        text = "\n".join(lines) + "\n"
        workers = workers_table(d, data, args.quick)
    text += "\n### Workers\n\n" + workers
    loader_batches, cold_batches = (20, 3) if args.quick else (160, 5)
    s3 = s3_requests(make_data(20_000 if args.quick else 200_000), 5 if args.quick else 20, loader_batches,
                     cold_batches)
    if s3 is not None:
        text += ("\n| S3 (moto) batch of 256 | requests per batch | chunks touched (arrays x chunks) | ms per batch (moto-bound) |\n"
                 "|---|---|---|---|\n" + "\n".join(s3[0]) + "\n")
        text += ("\n| S3 (moto) DataLoader, batches of 256 transitions | workers | batches | requests per batch "
                 "(server-side, worker start-up included) | samples/s (start-up included) |\n"
                 "|---|---|---|---|---|\n" + "\n".join(s3[1]) + "\n")
    body = (f"DataLoader over `TransitionDataset` / `SequenceDataset({T})` of a local {rows:,}-row store of (17,) f32 "
            f"obs, (6,) f32 actions and f32 rewards (raw chunks), random batches of {B} from `RandomBatchSampler`, "
            "`collate_fn=collate_batch`, fork workers, each row a fresh DataLoader: cold = its first batches, "
            "worker start-up included, steady = blocks of consecutive batches after those. numpy baseline: the same "
            "gather from arrays in RAM in one process. Workers: local stores of "
            f"{rows:,} vector rows (batches of {B}) and {2_000 if args.quick else 12_000:,} (84,84,4) uint8 frames "
            f"(batches of {IMG_B}), raw, lz4, zstd and JPEG per frame (`compressor={{\"obs\": \"jpeg:90\"}}`); "
            "the last table times a prepared batch that is only moved from a worker to the loop (the floor of any "
            "worker loader). S3: a cold batch (chunk cache dropped) read in-process through s3fs "
            "(`max_concurrency=1`) from a moto server on 127.0.0.1 (lz4 chunks of 1,024 rows). S3 DataLoader: the "
            "first batches of an epoch from a fresh dataset (nothing cached; a DataLoader with `collate_batch`) "
            "on the same store, requests counted by the server, uniformly random batches (`RandomBatchSampler`) "
            "against `ChunkShuffleSampler` (chunks in a random order, 4 at a time shuffled together), with and "
            "without the local chunk cache (`trajstore_chunk_cache`: empty, then warm from the run before).\n\n"
            + text)
    return section("Offline datasets (scripts/bench_offline.py)", "bench_offline.py", argv,
                   runs=f"numpy: median of {repeats} timings of 20 batches; steady: median of {blocks} blocks; cold: "
                        f"one fresh DataLoader per row; S3: median of {5 if args.quick else 20} cold batches; S3 DataLoader: "
                        f"one run of {loader_batches} batches per row ({cold_batches} for cold batches).",
                   body=body, quick=args.quick, started=started, packages=("torch", "s3fs", "moto"))


if __name__ == "__main__":
    print(main())
