"""One peer suite: every workload on every system in one run, as ratios against the numpy memmap
(the limit), written as one section of docs/benchmarks.md plus a PNG of sample latency against
store size.

Systems
    trajstore raw     ReplayBuffer / TrajectoryReplayBuffer, uncompressed chunks (the default)
    trajstore lz4     the same with ``compressor="lz4"``
    numpy memmap      ``np.lib.format.open_memmap`` / ``np.load(mmap_mode="r")``: the limit
    SB3               stable-baselines3's in-RAM ``ReplayBuffer`` (``add`` / ``sample``)
    TorchRL           ``LazyMemmapStorage`` (``RandomSampler``; ``SliceSampler`` for sequences),
                      reopened from its memmap folder with ``TensorDict.load_memmap``
    h5py              one chunked HDF5 dataset, no compression
    zarr-python       ``zarr.open_array`` on the trajstore raw store's array (reads only)

Workloads
    append            (17,) float32 and (84,84,4) uint8 rows, one at a time and in batches of 8,
                      into stores preallocated for the rows (trajstore: ``capacity=rows``)
    commit            after the appends: append 8 rows, then time the commit (trajstore
                      ``flush``, h5py ``flush``, memmap ``flush``); median of 20
    sample(256)       uniform, at several store sizes, each system freshly opened (its open time
                      is reported), page cache warm (the store was just written), no read pass
                      before timing: "cold" = the first 200 calls after opening, "steady" = the
                      calls after those
    sequences         256 windows of 32 consecutive (17,) f32 rows: trajstore
                      ``TrajectoryReplayBuffer.sample_sequences(256, 32)``, TorchRL
                      ``SliceSampler(slice_len=32)``, memmap gather of 256 random windows
    bytes on disk     allocated blocks of each system's files

Timing rule (docs/benchmarks.md): the systems run in blocks of consecutive calls (25 for reads,
1,000 for appends), block after block, and the order of the systems is rotated every round, so
neither gets the process's warm-up (allocator, page tables) for free.  A system whose calls have
used up its time budget for a workload stops after its current block; the table says how many
calls it made (cold and steady are the calls it made before and after the 200th).

    python scripts/bench_peers.py --png /tmp/peers.png    # default sizes (about 4 minutes on 2 cores)
    python scripts/bench_peers.py --quick                  # tiny sizes (a smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import section  # noqa: E402

from trajstore import ReplayBuffer, TrajectoryReplayBuffer

ROOT = Path(__file__).resolve().parents[1]
VEC, IMG = (17,), (84, 84, 4)
BATCH, SEQ = 256, 32
BLOCK, APPEND_BLOCK, COLD = 25, 1000, 200
HEADING = "Peer suite (scripts/bench_peers.py)"
Row = dict[str, Any]

RAW, LZ4, MM, SB3, TRL, H5, ZARR = ("trajstore raw", "trajstore lz4", "numpy memmap", "SB3", "TorchRL", "h5py",
                                     "zarr-python")
SKIPPED: dict[str, str] = {}


def _optional() -> None:
    """Import the optional peers; a missing one is skipped with its reason."""
    global torch, SB3ReplayBuffer, h5py, zarr, TensorDict, TorchRB, LazyMemmapStorage, TensorStorage
    global RandomSampler, SliceSampler
    import zarr  # noqa: F811 (a core dependency)

    try:
        import torch  # noqa: F811

        torch.set_num_threads(1)
        from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer  # noqa: F811
    except ImportError as e:
        SKIPPED[SB3] = f"not installed ({e}); pip install -e '.[sb3]'"
    try:
        import h5py  # noqa: F811
    except ImportError as e:
        SKIPPED[H5] = f"not installed ({e}); pip install -e '.[bench]'"
    try:
        import logging

        from tensordict import TensorDict  # noqa: F811
        from torchrl.data import LazyMemmapStorage, TensorStorage  # noqa: F811
        from torchrl.data import ReplayBuffer as TorchRB  # noqa: F811
        from torchrl.data.replay_buffers.samplers import RandomSampler, SliceSampler  # noqa: F811

        logging.getLogger("torchrl").setLevel(logging.WARNING)
    except ImportError as e:
        SKIPPED[TRL] = f"not installed ({e}); pip install -e '.[bench]'"
    for name, why in SKIPPED.items():
        print(f"skipping {name}: {why}", flush=True)


def active(names: list[str]) -> list[str]:
    return [n for n in names if n not in SKIPPED]


# ---------------------------------------------------------------------------------------------
# data


def vec_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *VEC), dtype=np.float32)


def img_rows(n: int, seed: int) -> np.ndarray:
    """Frames of 4x4-pixel blocks (Atari-like: lz4 finds repeats, about 5x)."""
    small = np.random.default_rng(seed).integers(0, 256, size=(n, 21, 21, 4), dtype=np.uint8)
    return small.repeat(4, axis=1).repeat(4, axis=2)


def rows_of(shape: tuple[int, ...]) -> Callable[[int, int], np.ndarray]:
    return vec_rows if shape == VEC else img_rows


def box(shape: tuple[int, ...]) -> gym.spaces.Box:
    return gym.spaces.Box(-np.inf, np.inf, shape, np.float32) if shape == VEC else gym.spaces.Box(0, 255, shape, np.uint8)


def h5_chunk(shape: tuple[int, ...], n: int) -> tuple[int, ...]:
    """About 64 KiB chunks: 1,024 vector rows, 2 frames."""
    return (min(n, 1024 if shape == VEC else 2), *shape)


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


# ---------------------------------------------------------------------------------------------
# timing


def run_blocks(systems: dict[str, Callable[[], Any]], calls: int, block: int, budget_s: float) -> dict[str, np.ndarray]:
    """Seconds of each of up to ``calls`` consecutive calls per system, in blocks of ``block``,
    systems rotated every round; a system stops (mid-block) once its calls have taken ``budget_s``."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    spent = {n: 0.0 for n in names}
    for r in range(-(-calls // block)):
        k = min(block, calls - r * block)
        for name in names[r % len(names):] + names[: r % len(names)]:
            if spent[name] > budget_s:
                continue
            fn, out = systems[name], times[name]
            for _ in range(k):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
                spent[name] += out[-1]
                if spent[name] > budget_s:
                    break
        if all(v > budget_s for v in spent.values()):
            break
    return {n: np.asarray(ts) for n, ts in times.items()}


def phases(ts: np.ndarray) -> tuple[float, float | None, int]:
    """(cold ms per call, steady ms per call or None, calls): cold = the first :data:`COLD`."""
    steady = float(ts[COLD:].mean() * 1e3) if len(ts) > COLD else None
    return float(ts[:COLD].mean() * 1e3), steady, len(ts)


# ---------------------------------------------------------------------------------------------
# append (and commit)


def _row_writer(target: Any, batch: int, nxt: Callable[[int], np.ndarray]) -> Callable[[], None]:
    """Appends to an array-like ``target`` (memmap, h5py dataset) by assignment: row ``i`` on each call
    (``batch == 1``), else rows ``i .. i + batch``, ``i`` counting up from 0."""
    c = [0]

    def go() -> None:
        i = c[0]
        c[0] += batch
        if batch == 1:
            target[i] = nxt(i)
        else:
            target[i : i + batch] = nxt(i)

    return go


def _open_and_run(ops: dict[str, Callable[[], Callable[[], Any]]], first: int, calls: int,
                  budget_s: float) -> tuple[dict[str, Any], dict[str, float]]:
    """Open every system (``ops[name]()`` returns its sampler; who opens, and then goes, first
    rotates with ``first``), then :func:`run_blocks` them; returns (times, open ms per system)."""
    names = list(ops)
    names = names[first % len(names):] + names[: first % len(names)]
    samplers, opened = {}, {}
    for name in names:
        t0 = time.perf_counter()
        samplers[name] = ops[name]()
        opened[name] = (time.perf_counter() - t0) * 1e3
    return run_blocks(samplers, calls, BLOCK, budget_s), opened


def appenders(tmp: Path, shape: tuple[int, ...], n: int, batch: int) -> dict[str, tuple[Callable, Callable | None, Callable, Path | None]]:
    """Per system: (append the next ``batch`` rows, commit or None, close, path)."""
    pool = rows_of(shape)(1024 + batch, 7)
    out: dict[str, tuple[Callable, Callable | None, Callable, Path | None]] = {}

    def nxt(i: int) -> np.ndarray:
        j = i % 1024
        return pool[j] if batch == 1 else pool[j : j + batch]

    for name, comp in ((RAW, None), (LZ4, "lz4")):
        p = tmp / f"{name.replace(' ', '_')}_append_{batch}"
        rb = ReplayBuffer.create(box(shape), cache_path=p, capacity=n + 64 * batch, compressor=comp, overwrite=True)
        c = [0]

        def go(rb=rb, c=c) -> None:
            c[0] += 1
            rb.append(nxt(c[0])) if batch == 1 else rb.extend(nxt(c[0]))

        out[name] = (go, rb.flush, rb.close, p)

    p = tmp / f"memmap_append_{batch}.npy"
    mm = np.lib.format.open_memmap(p, mode="w+", dtype=pool.dtype, shape=(n + 64 * batch, *shape))
    out[MM] = (_row_writer(mm, batch, nxt), mm.flush, lambda mm=mm: mm._mmap.close(), p)

    if SB3 not in SKIPPED:
        opt = shape == IMG  # SB3's own advice for frames: halve the RAM
        buf = SB3ReplayBuffer(-(-(n + 64 * batch) // batch) + 1, box(shape), gym.spaces.Discrete(4), "cpu", n_envs=batch,
                              optimize_memory_usage=opt, handle_timeout_termination=False)
        act, rew, done = np.zeros((batch, 1), np.int64), np.zeros(batch, np.float32), np.zeros(batch, bool)
        infos = [{}] * batch
        c = [0]

        def go_sb3(buf=buf, c=c) -> None:
            c[0] += 1
            o = nxt(c[0]).reshape(batch, *shape)
            buf.add(o, o, act, rew, done, infos)

        out[SB3] = (go_sb3, None, lambda: None, None)

    if TRL not in SKIPPED:
        p = tmp / f"torchrl_append_{batch}"
        trb = TorchRB(storage=LazyMemmapStorage(n + 64 * batch, scratch_dir=p), sampler=RandomSampler(), batch_size=BATCH)
        tpool = torch.from_numpy(pool)
        c = [0]

        def go_trl(trb=trb, c=c) -> None:
            c[0] += 1
            j = c[0] % 1024
            trb.add(tpool[j]) if batch == 1 else trb.extend(tpool[j : j + batch])

        out[TRL] = (go_trl, None, lambda: None, p)

    if H5 not in SKIPPED:
        p = tmp / f"h5py_append_{batch}.h5"
        f = h5py.File(p, "w")
        ds = f.create_dataset("obs", shape=(n + 64 * batch, *shape), dtype=pool.dtype, chunks=h5_chunk(shape, n))
        out[H5] = (_row_writer(ds, batch, nxt), f.flush, f.close, p)
    return out


def bench_append(tmp: Path, shape: tuple[int, ...], n: int, batch: int, budget_s: float) -> list[Row]:
    systems = appenders(tmp, shape, n, batch)
    calls = n // batch
    t = run_blocks({k: v[0] for k, v in systems.items()}, calls, APPEND_BLOCK, budget_s)
    rows = []
    for name, (go, commit, close, path) in systems.items():
        made = len(t[name])
        commit_ms = None
        if commit is not None:
            ts = []
            for _ in range(20):
                go()
                t0 = time.perf_counter()
                commit()
                ts.append(time.perf_counter() - t0)
            commit_ms = float(np.median(ts)) * 1e3
        close()
        ts = t[name]
        rows.append({"workload": f"append one {'x'.join(map(str, shape))} {'f32' if shape == VEC else 'u8'} array "
                                 f"(no other field), {batch} row{'s' if batch > 1 else ''} per call",
                     "system": name, "rows": made * batch, "rate": batch * (len(ts) - COLD) / ts[COLD:].sum(),
                     "cold_us": float(ts[:COLD].mean() * 1e6),
                     "commit_ms": commit_ms, "disk": disk_bytes(path) if path is not None else None})
        print(f"  {rows[-1]['workload']:<32} {name:<14} {rows[-1]['rate']:>12,.0f} rows/s "
              f"commit {commit_ms if commit_ms is None else round(commit_ms, 3)} ms", flush=True)
    for _, _, _, path in systems.values():
        if path is not None:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    gc.collect()
    return rows


# ---------------------------------------------------------------------------------------------
# uniform sample(256)


def build(tmp: Path, shape: tuple[int, ...], n: int) -> dict[str, Any]:
    """Every system's store of the same ``n`` rows; returns their paths (and SB3's buffer)."""
    make = rows_of(shape)
    dtype = np.float32 if shape == VEC else np.uint8
    step = 65536 if shape == VEC else 2048
    paths: dict[str, Any] = {RAW: tmp / "raw", LZ4: tmp / "lz4", MM: tmp / "mm.npy", TRL: tmp / "torchrl", H5: tmp / "h5.h5"}
    rbs = [ReplayBuffer.create(box(shape), cache_path=paths[RAW], capacity=n, overwrite=True),
           ReplayBuffer.create(box(shape), cache_path=paths[LZ4], capacity=n, compressor="lz4", overwrite=True)]
    mm = np.lib.format.open_memmap(paths[MM], mode="w+", dtype=dtype, shape=(n, *shape))
    st = LazyMemmapStorage(n, scratch_dir=paths[TRL]) if TRL not in SKIPPED else None
    f = h5py.File(paths[H5], "w") if H5 not in SKIPPED else None
    ds = f.create_dataset("obs", shape=(n, *shape), dtype=dtype, chunks=h5_chunk(shape, n)) if f is not None else None
    sb3 = None
    if SB3 not in SKIPPED:
        sb3 = SB3ReplayBuffer(n, box(shape), gym.spaces.Discrete(4), "cpu", optimize_memory_usage=shape == IMG,
                              handle_timeout_termination=False)
    for lo in range(0, n, step):
        x = make(min(step, n - lo), lo)
        for rb in rbs:
            rb.extend(x)
        mm[lo : lo + len(x)] = x
        if st is not None:
            st.set(torch.arange(lo, lo + len(x)), TensorDict({"obs": torch.from_numpy(x)}, batch_size=[len(x)]))
        if ds is not None:
            ds[lo : lo + len(x)] = x
        if sb3 is not None:
            sb3.observations[lo : lo + len(x), 0] = x
            if not sb3.optimize_memory_usage:
                sb3.next_observations[lo : lo + len(x), 0] = x
    for rb in rbs:
        rb.close()
    mm.flush()
    del mm
    if f is not None:
        f.close()
    if sb3 is not None:
        sb3.full, sb3.pos = True, 0
    paths[SB3] = sb3
    del st
    gc.collect()
    return paths


def openers(paths: dict[str, Any], shape: tuple[int, ...], n: int, seed: int) -> dict[str, Callable[[], Callable[[], Any]]]:
    """Per system: open the store and return its ``sample(256)``."""

    def ts(p: Path) -> Callable[[], Any]:
        rb = ReplayBuffer.load_from(p, read_only=True)
        g = np.random.default_rng(seed)
        return lambda: rb.sample(BATCH, rng=g)

    def mm() -> Callable[[], Any]:
        a, g = np.load(paths[MM], mmap_mode="r"), np.random.default_rng(seed)
        return lambda: a[g.integers(0, n, BATCH)]

    def sb3() -> Callable[[], Any]:
        buf = paths[SB3]
        return lambda: buf.sample(BATCH)

    def trl() -> Callable[[], Any]:
        rb = TorchRB(storage=TensorStorage(TensorDict.load_memmap(paths[TRL]), max_size=n), sampler=RandomSampler(),
                     batch_size=BATCH)
        return lambda: rb.sample()

    def h5() -> Callable[[], Any]:
        ds, g = h5py.File(paths[H5], "r")["obs"], np.random.default_rng(seed)
        if shape == VEC:  # h5py's fancy index takes increasing, distinct rows
            return lambda: ds[np.unique(g.integers(0, n, BATCH))]
        # for frames its fancy index is ~60x slower than reading the rows one by one
        return lambda: np.stack([ds[i] for i in g.integers(0, n, BATCH)])

    def za() -> Callable[[], Any]:
        a, g = zarr.open_array(store=str(paths[RAW] / "step_data"), mode="r"), np.random.default_rng(seed)
        return lambda: a.oindex[g.integers(0, n, BATCH)]

    found = {RAW: lambda: ts(paths[RAW]), LZ4: lambda: ts(paths[LZ4]), MM: mm, SB3: sb3, TRL: trl, H5: h5, ZARR: za}
    return {k: v for k, v in found.items() if k not in SKIPPED}


def bench_sample(tmp: Path, shape: tuple[int, ...], n: int, calls: int, budget_s: float, first: int) -> list[Row]:
    d = tmp / f"sample_{'vec' if shape == VEC else 'img'}_{n}"
    d.mkdir()
    t0 = time.perf_counter()
    paths = build(d, shape, n)
    built = time.perf_counter() - t0
    ops = openers(paths, shape, n, seed=n)
    t, opened = _open_and_run(ops, first, calls, budget_s)
    rows = []
    kind = "vector (17,) f32" if shape == VEC else "image (84,84,4) u8"
    for name in ops:
        cold, steady, made = phases(t[name])
        disk = disk_bytes(paths[name]) if name in (RAW, LZ4, MM, TRL, H5) else None
        rows.append({"kind": kind, "n": n, "system": name, "open_ms": opened[name] if name != SB3 else None,
                     "cold": cold, "steady": steady, "calls": made, "disk": disk})
    mmr = next(r for r in rows if r["system"] == MM)
    for r in rows:
        r["cold_ratio"] = r["cold"] / mmr["cold"]
        r["steady_ratio"] = r["steady"] / mmr["steady"] if r["steady"] is not None and mmr["steady"] else None
        print(f"  sample {kind} {n:>10,} {r['system']:<14} cold {r['cold']:8.3f} ms steady "
              f"{'-' if r['steady'] is None else format(r['steady'], '8.3f')} ms ({r['calls']} calls) "
              f"open {r['open_ms'] if r['open_ms'] is None else round(r['open_ms'], 2)} ms", flush=True)
    print(f"  (built in {built:.1f} s)", flush=True)
    del ops, paths
    gc.collect()
    shutil.rmtree(d, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------------
# sequences 256 x 32


def bench_sequences(tmp: Path, n: int, calls: int, budget_s: float, first: int) -> list[Row]:
    d = tmp / f"seq_{n}"
    d.mkdir()
    g = np.random.default_rng(3)
    lengths = g.integers(250, 751, size=n // 250 + 2)
    ids = np.repeat(np.arange(len(lengths)), lengths)[:n]
    tb = TrajectoryReplayBuffer.create(box(VEC), cache_path=d / "tb", step_data_capacity=n)
    mm = np.lib.format.open_memmap(d / "mm.npy", mode="w+", dtype=np.float32, shape=(n, *VEC))
    st = LazyMemmapStorage(n, scratch_dir=d / "torchrl") if TRL not in SKIPPED else None
    for lo in range(0, n, 65536):
        x = vec_rows(min(65536, n - lo), lo)
        e = ids[lo : lo + len(x)]
        tb.extend({"step_data": x, "episode_ids": e})
        mm[lo : lo + len(x)] = x
        if st is not None:
            st.set(torch.arange(lo, lo + len(x)), TensorDict({"obs": torch.from_numpy(x), "episode": torch.from_numpy(e)},
                                                          batch_size=[len(x)]))
    tb.close()
    mm.flush()
    del mm, st
    gc.collect()

    def o_ts() -> Callable[[], Any]:
        b, r = TrajectoryReplayBuffer.load_from(d / "tb", read_only=True), np.random.default_rng(5)
        return lambda: b.sample_sequences(BATCH, SEQ, rng=r)

    def o_mm() -> Callable[[], Any]:
        a, r, ar = np.load(d / "mm.npy", mmap_mode="r"), np.random.default_rng(5), np.arange(SEQ)
        return lambda: a[(r.integers(0, n - SEQ + 1, BATCH)[:, None] + ar).ravel()].reshape(BATCH, SEQ, *VEC)

    def o_trl() -> Callable[[], Any]:
        # cache_values: the peer's option for a static store (trajectory bounds computed once)
        rb = TorchRB(storage=TensorStorage(TensorDict.load_memmap(d / "torchrl"), max_size=n),
                     sampler=SliceSampler(slice_len=SEQ, traj_key="episode", cache_values=True),
                     batch_size=BATCH * SEQ)
        return lambda: rb.sample()

    ops = {RAW: o_ts, MM: o_mm, TRL: o_trl}
    ops = {k: v for k, v in ops.items() if k not in SKIPPED}
    t, opened = _open_and_run(ops, first, calls, budget_s)
    rows = []
    for name in ops:
        cold, steady, made = phases(t[name])
        rows.append({"n": n, "system": name, "cold": cold, "steady": steady, "calls": made, "open_ms": opened[name],
                     "disk": disk_bytes(d / {RAW: "tb", MM: "mm.npy", TRL: "torchrl"}[name])})
    mmr = next(r for r in rows if r["system"] == MM)
    for r in rows:
        r["cold_ratio"] = r["cold"] / mmr["cold"]
        r["steady_ratio"] = r["steady"] / mmr["steady"] if r["steady"] is not None and mmr["steady"] else None
        print(f"  sequences {n:>10,} {r['system']:<14} cold {r['cold']:8.3f} ms steady "
              f"{'-' if r['steady'] is None else format(r['steady'], '8.3f')} ms ({r['calls']} calls)", flush=True)
    del ops
    gc.collect()
    shutil.rmtree(d, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------------
# machine, report


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:,.1f}"


def key_ratios(sample: list[Row]) -> list[str]:
    """trajstore raw against the memmap, SB3 and TorchRL, per kind and size (cold / steady)."""
    lines = []
    for kind in dict.fromkeys(r["kind"] for r in sample):
        for n in dict.fromkeys(r["n"] for r in sample if r["kind"] == kind):
            at = {r["system"]: r for r in sample if r["kind"] == kind and r["n"] == n}
            ours = at.get(RAW)
            parts = []
            for peer in (MM, SB3, TRL):
                if ours is None or peer not in at:
                    continue
                p = at[peer]
                st = (ours["steady"] / p["steady"]) if ours["steady"] is not None and p["steady"] else None
                parts.append(f"vs {peer} {ours['cold'] / p['cold']:.2f}x cold / {_r(st)} steady")
            lines.append(f"- {kind}, {n:,} rows: trajstore raw " + "; ".join(parts))
    return lines


def report(argv: list[str], store_dir: Path, started: float, quick: bool, cfg: str, append: list[Row],
           sample: list[Row], seqs: list[Row], png: Path | None) -> str:
    out = [f"Sizes: {cfg}.", "",
            "Ratios are time per call (or per row) of the system divided by the numpy memmap's, measured side by "
            "side in this run (lower is better; the memmap is the limit). Reads: blocks of 25 consecutive calls per "
            "system, systems rotated each round (and which one opens and goes first alternates between sizes), no read "
            "pass before timing; page cache warm (the stores were just written), each system freshly opened: "
            f"cold = the first {COLD} calls after opening, steady = the calls after those. SB3's `sample` returns "
            "obs, next_obs, actions, rewards and dones as torch tensors (it gathers two obs arrays; for frames it uses "
            "its `optimize_memory_usage=True`); TorchRL returns a TensorDict; h5py (chunks of about 64 KiB, no "
            "compression) reads vectors with its fancy index of sorted distinct rows (the sort is counted) and frames "
            "row by row (`np.stack([ds[i] for i in idx])`); zarr-python reads the trajstore raw store's array with "
            "`oindex`. A system that used up its time budget shows fewer calls (and no steady figure if it stopped "
            f"within the first {COLD})."]
    for name, why in SKIPPED.items():
        out += ["", f"Skipped {name}: {why}."]
    ratios = key_ratios(sample)
    if ratios:
        out += ["", "### Key ratios: trajstore raw `sample(256)`", ""] + ratios
    out += ["", "### Uniform sample(256)", "",
            "| rows | system | open ms | disk MB | cold ms/call | steady ms/call | calls | cold vs memmap | steady vs memmap |",
            "|---|---|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in sample):
        out.append(f"| **{kind}** | | | | | | | | |")
        for r in (r for r in sample if r["kind"] == kind):
            out.append(f"| {r['n']:,} | {r['system']} | {_f(r['open_ms'], '.2f')} | {_mb(r['disk'])} | {_f(r['cold'])} | "
                       f"{_f(r['steady'])} | {r['calls']} | {_r(r['cold_ratio'])} | {_r(r['steady_ratio'])} |")
    if png is not None:
        out += ["", f"![sample(256) latency against store size]({png.name})"]
    out += ["", "### Append and commit", "",
            "One array, no other field (unlike the Core section's whole transitions): rows appended one call at a time "
            "(`append` / `add` / `mm[i] = x` / `ds[i] = x`) or 8 rows per call (`extend`, SB3 with 8 envs), in blocks of "
            f"{APPEND_BLOCK:,} consecutive calls, systems rotated; cold = the mean of the first {COLD} calls, rows/s "
            "over the calls after those. SB3's `add` copies obs and next_obs. Commit: append 8 rows, then `flush()` "
            "(trajstore, h5py) or `mm.flush()` (msync); median of 20. TorchRL and SB3 have no commit. Time ratio = "
            "steady seconds per row / the memmap's (lower is better).", "",
            "| workload | system | rows | cold us/call | steady rows/s | time vs memmap | time vs SB3 | commit ms | disk MB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for wl in dict.fromkeys(r["workload"] for r in append):
        at = {r["system"]: r for r in append if r["workload"] == wl}
        for r in at.values():
            vs_sb3 = at[SB3]["rate"] / r["rate"] if SB3 in at else None
            out.append(f"| {wl} | {r['system']} | {r['rows']:,} | {r['cold_us']:.1f} | {r['rate']:,.0f} | "
                       f"{at[MM]['rate'] / r['rate']:.2f}x | "
                       f"{_r(vs_sb3)} | {_f(r['commit_ms'])} | {_mb(r['disk'])} |")
    out += ["", "### Sequences 256 x 32", "",
            "(17,) f32 steps in episodes of 250-750 steps. trajstore: `TrajectoryReplayBuffer.sample_sequences(256, 32)` "
            "(read-only, default `within_episode=False`, edge padding); TorchRL: `SliceSampler(slice_len=32, "
            "traj_key=\"episode\", cache_values=True)` on `LazyMemmapStorage` (batch 8,192 = 256 slices); memmap: "
            "gather of 256 random windows of 32 rows (no episode logic).", "",
            "| rows | system | open ms | disk MB | cold ms/call | steady ms/call | calls | cold vs memmap | steady vs memmap |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in seqs:
        out.append(f"| {r['n']:,} | {r['system']} | {_f(r['open_ms'], '.2f')} | {_mb(r['disk'])} | {_f(r['cold'])} | "
                   f"{_f(r['steady'])} | {r['calls']} | {_r(r['cold_ratio'])} | {_r(r['steady_ratio'])} |")
    ns = sorted(dict.fromkeys(r["n"] for r in seqs))
    if len(ns) >= 2:
        out.append("")
        for name in dict.fromkeys(r["system"] for r in seqs):
            a = next(r for r in seqs if r["n"] == ns[0] and r["system"] == name)
            b = next(r for r in seqs if r["n"] == ns[-1] and r["system"] == name)
            if a["steady"] and b["steady"]:
                out.append(f"- {name}: steady {ns[-1]:,} rows / {ns[0]:,} rows = {b['steady'] / a['steady']:.2f} "
                           f"(cold {b['cold'] / a['cold']:.2f})")
    body = "\n".join(l for i, l in enumerate(out) if not (l == "" and i > 0 and out[i - 1] == ""))
    return section(HEADING, "bench_peers.py", argv, runs="one run: each cold figure is the mean of a system's first "
                   f"{COLD} calls, each steady figure the mean of its calls after those; commit: median of 20.",
                   body=body, quick=quick, started=started, store_dir=store_dir,
                   packages=("numcodecs", "torch", "stable-baselines3", "torchrl", "tensordict", "h5py"))


def plot(sample: list[Row], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(r["kind"] for r in sample))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 4.8), squeeze=False)
    colors = dict(zip([RAW, LZ4, MM, SB3, TRL, H5, ZARR], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, kind in zip(axes[0], kinds):
        for name in dict.fromkeys(r["system"] for r in sample if r["kind"] == kind):
            rs = [r for r in sample if r["kind"] == kind and r["system"] == name]
            ax.plot([r["n"] for r in rs], [r["cold"] for r in rs], "--", color=colors[name], alpha=0.6)
            st = [(r["n"], r["steady"]) for r in rs if r["steady"] is not None]
            if st:
                ax.plot(*zip(*st), "o-", color=colors[name], label=name)
            else:
                ax.plot([], [], "o-", color=colors[name], label=f"{name} (cold only)")
        ax.set(xscale="log", yscale="log", xlabel="rows in store", ylabel="ms per sample(256)",
               title=f"{kind}: steady (solid), cold first {COLD} (dashed)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds per workload (a smoke test)")
    ap.add_argument("--png", type=Path, default=None, help="plot file (bench_all.py: docs/bench_peers.png; default: none)")
    ap.add_argument("--dir", type=Path, default=None, help="folder for the stores (default: the temp folder)")
    ap.add_argument("--max-image-rows", type=int, default=50_000,
                    help="largest image store for sample(256) (default 50,000 = 1.4 GB per system; 200,000 = 5.6 GB)")
    ap.add_argument("--max-vector-rows", type=int, default=10_000_000, help="largest vector store (default 1e7)")
    ap.add_argument("--append-vector-rows", type=int, default=None, help="default 300,000")
    ap.add_argument("--append-image-rows", type=int, default=None, help="default 20,000")
    ap.add_argument("--calls", type=int, default=None, help="calls per system per read workload (default 600)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per system per workload (default 5)")
    ap.add_argument("--skip", type=str, default="", help="comma-separated workloads to leave out: append,sample,sequences")
    a = ap.parse_args(argv)
    q = a.quick
    calls = a.calls or (250 if q else 600)
    budget = a.budget or (1.0 if q else 5.0)
    vsizes = [s for s in ([1000, 10_000] if q else [10_000, 100_000, 1_000_000, 10_000_000]) if s <= a.max_vector_rows]
    isizes = [s for s in ([200, 1000] if q else [1000, 10_000, 100_000, 200_000]) if s <= a.max_image_rows]
    if not q and a.max_image_rows not in isizes and a.max_image_rows < 200_000:
        isizes.append(a.max_image_rows)
    isizes.sort()
    ssizes = [2000, 20_000] if q else [100_000, 10_000_000]
    av = a.append_vector_rows or (4000 if q else 300_000)
    ai = a.append_image_rows or (400 if q else 20_000)
    skip = set(filter(None, a.skip.split(",")))
    png = a.png
    cfg = (f"append {av:,} vector rows and {ai:,} image rows; sample(256) at {', '.join(f'{s:,}' for s in vsizes)} vector "
           f"rows and {', '.join(f'{s:,}' for s in isizes)} image rows; sequences at {', '.join(f'{s:,}' for s in ssizes)} "
           f"rows; {calls} calls per system per read workload, time budget {budget:g} s per system per workload")
    _optional()
    base = a.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    append: list[Row] = []
    sample: list[Row] = []
    seqs: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench_peers_", dir=base) as d:
        tmp = Path(d)
        if "append" not in skip:
            for shape, n in ((VEC, av), (IMG, ai)):
                for batch in (1, 8):
                    append += bench_append(tmp, shape, n, batch, budget)
        k = 0
        if "sample" not in skip:
            for shape, sizes in ((VEC, vsizes), (IMG, isizes)):
                for n in sizes:
                    sample += bench_sample(tmp, shape, n, calls, budget, k)
                    k += 1
        if "sequences" not in skip:
            for n in ssizes:
                seqs += bench_sequences(tmp, n, calls, budget, k)
                k += 1
    if png is not None and sample:
        plot(sample, png)
        print(f"wrote {png}")
    return report(argv, base, started, q, cfg, append, sample, seqs, png if sample else None)


if __name__ == "__main__":
    print(main())
