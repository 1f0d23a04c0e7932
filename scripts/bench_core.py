"""Core store benchmark: a training loop's two calls on a ``ReplayBuffer``, appending
transitions and ``sample(256)``, against a numpy memmap of the same five fields and
stable-baselines3's in-RAM ``ReplayBuffer``, side by side in one run; then the store's open and
the three compressor choices.

    python scripts/bench_core.py            # 1e6 vector / 10,000 image rows sampled (about 90 s)
    python scripts/bench_core.py --quick    # tiny sizes (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there; run
alone, the script prints it).  Every workload runs ``ROUNDS`` times on freshly created or opened
systems; calls run in blocks of consecutive calls, the systems' order rotated each block; cold is
the mean of the first :data:`COLD` calls of a round, steady the mean of the rest, and the table
shows the median over the rounds.  Page cache warm (the stores were just written), no read pass
before timing.
"""

from __future__ import annotations

import argparse
import logging
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import cold_steady_note, section  # noqa: E402

from trajstore import ReplayBuffer  # noqa: E402

#: Consecutive calls of one system before the next system's turn, and the calls after opening
#: that count as cold (the process's mappings of a freshly opened store not yet faulted in).
BLOCK, COLD = 25, 200
#: appends are cheap: blocks of 1,000 consecutive calls
APPEND_BLOCK = 1000
#: fresh systems per workload: every median in this section is over this many rounds (--quick: 2)
ROUNDS = 5
VEC, IMG = (17,), (84, 84, 4)


def run_blocks(systems: dict[str, Callable[[], Any]], calls: int, block: int = BLOCK) -> dict[str, np.ndarray]:
    """Seconds of each of ``calls`` consecutive calls per system, in blocks of ``block``, the
    systems' order rotated every round (neither gets the process's warm-up for free; blocks, not
    single calls interleaved, are how a training loop calls)."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(-(-calls // block)):
        k = min(block, calls - r * block)
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, out = systems[name], times[name]
            for _ in range(k):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
    return {n: np.asarray(ts) for n, ts in times.items()}


def _median_time(fn: Callable[[], Any], repeats: int, inner: int, warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` rounds of ``inner`` calls, after
    ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def _fields(obs_shape: tuple[int, ...]) -> list[tuple[str, Any, tuple[int, ...]]]:
    dt = np.uint8 if obs_shape == IMG else np.float32
    return [("obs", dt, obs_shape), ("next_obs", dt, obs_shape), ("action", np.float32, (6,)),
            ("reward", np.float32, ()), ("done", np.float32, ())]


def _space(obs_shape: tuple[int, ...]) -> gym.spaces.Dict:
    lo, hi = (0, 255) if obs_shape == IMG else (-np.inf, np.inf)
    return gym.spaces.Dict({name: gym.spaces.Box(lo if name.endswith("obs") else -np.inf,
                                                 hi if name.endswith("obs") else np.inf, shape, dt)
                            for name, dt, shape in _fields(obs_shape)})


def _pool(obs_shape: tuple[int, ...], n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` random transitions, one array per field."""
    rng = np.random.default_rng(seed)
    obs = (rng.integers(0, 255, (n, *obs_shape)).astype(np.uint8) if obs_shape == IMG
           else rng.standard_normal((n, *obs_shape)).astype(np.float32))
    return {"obs": obs, "next_obs": obs, "action": rng.uniform(-1, 1, (n, 6)).astype(np.float32),
            "reward": np.ones(n, np.float32), "done": np.zeros(n, np.float32)}


def _sb3(capacity: int, obs_shape: tuple[int, ...], n_envs: int) -> Any:
    try:
        from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer
    except ImportError:
        return None
    space = _space(obs_shape)
    return SB3ReplayBuffer(capacity, space["obs"], space["action"], device="cpu", n_envs=n_envs,
                           handle_timeout_termination=False)


def _phases(ts: np.ndarray, cold: int) -> tuple[float, float]:
    """(cold, steady) mean seconds per call: the first ``cold`` calls, the rest."""
    return float(ts[:cold].mean()), float(ts[cold:].mean()) if len(ts) > cold else float("nan")


def _medians(per_round: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    return {k: (statistics.median(r[k][0] for r in per_round), statistics.median(r[k][1] for r in per_round))
            for k in per_round[0]}


def bench_append(tmp: Path, obs_shape: tuple[int, ...], batch: int, calls: int, rounds: int,
                 cold: int) -> list[dict[str, Any]]:
    """``calls`` appends of ``batch`` transitions per system and round, each round on new systems."""
    pool = _pool(obs_shape, 1024 + batch, 0)
    # prepared views, so that every system's call costs the same to feed
    blocks = [{k: v[j:j + batch] for k, v in pool.items()} for j in range(1024)]
    singles = [{k: v[j] for k, v in pool.items()} for j in range(1024)]
    rows = calls * batch
    per_round = []
    for rnd in range(rounds):
        rb = ReplayBuffer.create(_space(obs_shape), cache_path=tmp / f"append_{rnd}", overwrite=True)
        mm = {k: np.lib.format.open_memmap(tmp / f"append_{rnd}_{k}.npy", mode="w+", dtype=dt, shape=(rows, *shape))
              for k, dt, shape in _fields(obs_shape)}
        pos = {"trajstore": 0, "memmap": 0, "sb3": 0}

        def ours() -> None:
            i = pos["trajstore"]
            pos["trajstore"] = i + 1
            rb.append(singles[i & 1023]) if batch == 1 else rb.extend(blocks[i & 1023])

        def memmap() -> None:
            i = pos["memmap"]
            pos["memmap"] = i + 1
            t = blocks[i & 1023]
            for k, a in mm.items():
                a[i * batch:(i + 1) * batch] = t[k]

        systems: dict[str, Callable[[], Any]] = {"trajstore": ours, "numpy memmap": memmap}
        sb3 = _sb3(calls + 1, obs_shape, batch)
        if sb3 is not None:
            infos: list[dict[str, Any]] = [{}] * batch

            def add() -> None:
                i = pos["sb3"]
                pos["sb3"] = i + 1
                t = blocks[i & 1023]
                sb3.add(t["obs"], t["next_obs"], t["action"], t["reward"], t["done"], infos)
            systems["SB3"] = add
        names = list(systems)
        systems = {n: systems[n] for n in names[rnd % len(names):] + names[:rnd % len(names)]}
        t = run_blocks(systems, calls, APPEND_BLOCK)
        rb.close()
        for a in mm.values():
            a._mmap.close()
        per_round.append({k: _phases(v, cold) for k, v in t.items()})
    what = (f"append transitions (obs + next_obs {'x'.join(map(str, obs_shape))} "
            f"{'u8' if obs_shape == IMG else 'f32'}, action (6,), reward, done), {batch} per call")
    return [{"what": what, "system": k, "cold": c_, "steady": s, "batch": batch, "calls": calls}
            for k, (c_, s) in _medians(per_round).items()]


def build_sample_store(tmp: Path, obs_shape: tuple[int, ...], n: int) -> tuple[Path, Any]:
    """The trajstore store and memmap files of ``n`` transitions, and an SB3 buffer holding them."""
    path = tmp / f"sample_{len(obs_shape)}"
    rb = ReplayBuffer.create(_space(obs_shape), cache_path=path, overwrite=True)
    mm = {k: np.lib.format.open_memmap(f"{path}.{k}.npy", mode="w+", dtype=dt, shape=(n, *shape))
          for k, dt, shape in _fields(obs_shape)}
    sb3 = _sb3(n, obs_shape, 1)
    block = 4096
    for lo in range(0, n, block):
        t = _pool(obs_shape, min(block, n - lo), lo)
        rb.extend(t)
        for k, a in mm.items():
            a[lo:lo + len(t["obs"])] = t[k]
        if sb3 is not None:
            hi = lo + len(t["obs"])
            sb3.observations[lo:hi, 0] = t["obs"]
            sb3.next_observations[lo:hi, 0] = t["next_obs"]
            sb3.actions[lo:hi, 0] = t["action"]
            sb3.rewards[lo:hi, 0] = 1.0
    rb.close()
    for a in mm.values():
        a.flush()
    if sb3 is not None:
        sb3.pos, sb3.full = 0, True
    return path, sb3


def bench_sample(path: Path, sb3: Any, obs_shape: tuple[int, ...], n: int, calls: int,
                 rounds: int, cold: int) -> list[dict[str, Any]]:
    """``sample(256)`` of whole transitions: trajstore (numpy and torch backends), the memmap
    gather of the same five fields, SB3's sample; every round opens the stores afresh."""
    rng = np.random.default_rng(1)
    per_round = []
    for rnd in range(rounds):
        ro = ReplayBuffer.load_from(path, read_only=True)
        rt = ReplayBuffer.load_from(path, read_only=True, backend="torch")
        mm = {k: np.load(f"{path}.{k}.npy", mmap_mode="r") for k, _, _ in _fields(obs_shape)}

        def gather() -> Any:
            idx = rng.integers(0, n, 256)
            return {k: a[idx] for k, a in mm.items()}

        systems: dict[str, Callable[[], Any]] = {
            "trajstore": lambda: ro.sample(256, rng=rng), "trajstore, torch backend": lambda: rt.sample(256, rng=rng),
            "numpy memmap": gather}
        if sb3 is not None:
            systems["SB3 (in RAM, torch)"] = lambda: sb3.sample(256)
        names = list(systems)
        systems = {k: systems[k] for k in names[rnd % len(names):] + names[:rnd % len(names)]}
        t = run_blocks(systems, calls)
        ro.close()
        rt.close()
        per_round.append({k: _phases(v, cold) for k, v in t.items()})
    what = f"sample(256) transitions, obs {'x'.join(map(str, obs_shape))} {'u8' if obs_shape == IMG else 'f32'}"
    return [{"what": what, "n": n, "system": k, "cold": c_, "steady": s, "calls": calls}
            for k, (c_, s) in _medians(per_round).items()]


def bench_open(path: Path, n: int) -> list[tuple[str, float]]:
    """``load_from`` (read-only) and ``dumps()`` of the vector store: metadata only."""
    t_load = _median_time(lambda: ReplayBuffer.load_from(path, read_only=True).close(), 9, 1, 0)
    rb = ReplayBuffer.load_from(path)
    t_dump = _median_time(rb.dumps, 9, 1, 0)
    rb.close()
    return [(f"`ReplayBuffer.load_from(path, read_only=True)`, {n:,} rows", t_load),
            (f"`dumps()` to its own path, {n:,} rows", t_dump)]


def bench_layouts(tmp: Path, n: int, calls: int, rounds: int, cold: int) -> list[dict[str, Any]]:
    """Per compressor: size against raw, ``extend`` rows/s (8,192-row blocks), and sample(256)
    of (17,) f32 rows (a random walk: continuous states compress little, like real observations)."""
    from trajstore.maintenance.summary import store_info

    rng = np.random.default_rng(3)
    data = np.cumsum(rng.standard_normal((n, 17)).astype(np.float32) * 0.01, axis=0)
    comps = (None, "lz4", "zstd")
    writes: dict[Any, list[float]] = {c: [] for c in comps}
    per_round = []
    for rnd in range(rounds):
        opened = {}
        for comp in comps[rnd % 3:] + comps[:rnd % 3]:
            path = tmp / f"layout_{comp}_{rnd}"
            rb = ReplayBuffer.create(gym.spaces.Box(-np.inf, np.inf, (17,), np.float32), cache_path=path,
                                     compressor=comp)
            t0 = time.perf_counter()
            for lo in range(0, n, 8192):
                rb.extend(data[lo:lo + 8192])
            rb.close()
            writes[comp].append(n / (time.perf_counter() - t0))
            opened[comp] = ReplayBuffer.load_from(path, read_only=True)
        t = run_blocks({str(c): (lambda ro=ro: ro.sample(256, rng=rng)) for c, ro in opened.items()}, calls)
        for ro in opened.values():
            ro.close()
        per_round.append({k: _phases(v, cold) for k, v in t.items()})
    med = _medians(per_round)
    out = []
    for comp in comps:
        ratio = store_info(tmp / f"layout_{comp}_0")["compression_ratio"]  # None for raw stores
        out.append({"comp": comp, "ratio": ratio, "extend": statistics.median(writes[comp]),
                    "cold": med[str(comp)][0], "steady": med[str(comp)][1]})
    return out


def _x(a: float, b: float | None) -> str:
    return "-" if b is None or not b == b else f"{a / b:.2f}x"


def tables(append: list[dict[str, Any]], sample: list[dict[str, Any]], opens: list[tuple[str, float]],
           layouts: list[dict[str, Any]]) -> str:
    out = ["### Append", "",
           "| workload | system | cold us/call | steady us/call | steady rows/s | steady time vs memmap | "
           "steady time vs SB3 |", "|---|---|---|---|---|---|---|"]
    for what in dict.fromkeys(r["what"] for r in append):
        at = {r["system"]: r for r in append if r["what"] == what}
        for r in at.values():
            out.append(f"| {what} | {r['system']} | {r['cold'] * 1e6:.1f} | {r['steady'] * 1e6:.1f} | "
                       f"{r['batch'] / r['steady']:,.0f} | {_x(r['steady'], at['numpy memmap']['steady'])} | "
                       f"{_x(r['steady'], at['SB3']['steady'] if 'SB3' in at else None)} |")
    out += ["", "### sample(256)", "",
            "| workload | rows | system | cold ms/call | steady ms/call | cold vs memmap | steady vs memmap |",
            "|---|---|---|---|---|---|---|"]
    for what in dict.fromkeys(r["what"] for r in sample):
        at = {r["system"]: r for r in sample if r["what"] == what}
        mm = at["numpy memmap"]
        for r in at.values():
            out.append(f"| {what} | {r['n']:,} | {r['system']} | {r['cold'] * 1e3:.3f} | {r['steady'] * 1e3:.3f} | "
                       f"{_x(r['cold'], mm['cold'])} | {_x(r['steady'], mm['steady'])} |")
    out += ["", "### Open", "", "| measurement | ms (median of 9) |", "|---|---|"]
    out += [f"| {what} | {t * 1e3:.2f} |" for what, t in opens]
    out += ["", "### Compressors: (17,) f32 rows", "",
            "| compressor | size vs raw | extend rows/s | sample(256) cold ms | sample(256) steady ms | "
            "steady vs raw |", "|---|---|---|---|---|---|"]
    raw = layouts[0]
    for r in layouts:
        ratio = "1 (raw)" if r["ratio"] is None else f"{r['ratio']:.2f}x smaller"
        out.append(f"| {r['comp'] or 'none'} | {ratio} | {r['extend']:,.0f} | {r['cold'] * 1e3:.3f} | "
                   f"{r['steady'] * 1e3:.3f} | {_x(r['steady'], raw['steady'])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--vec-rows", type=int, default=None, help="vector store sampled (default 1,000,000)")
    p.add_argument("--img-rows", type=int, default=None, help="image store sampled (default 10,000)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    a = p.parse_args(argv)
    q = a.quick
    vec, img = a.vec_rows or (5_000 if q else 1_000_000), a.img_rows or (300 if q else 10_000)
    rounds = 2 if q else ROUNDS
    cold = 20 if q else COLD  # --quick: a smoke test of every row, cold over fewer calls
    sample_calls, img_calls = (cold + 25, cold + 10) if q else (cold + 800, cold + 300)
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        tmp = Path(d)
        append = bench_append(tmp, VEC, 1, 60 if q else 10_000, rounds, cold)
        append += bench_append(tmp, VEC, 8, 60 if q else 2_500, rounds, cold)
        append += bench_append(tmp, IMG, 1, 60 if q else 2_000, rounds, cold)
        sample = []
        for shape, n, calls in ((VEC, vec, sample_calls), (IMG, img, img_calls)):
            path, sb3 = build_sample_store(tmp, shape, n)
            sample += bench_sample(path, sb3, shape, n, calls, rounds, cold)
            if shape == VEC:
                opens = bench_open(path, n)
            del sb3
        layouts = bench_layouts(tmp, 5_000 if q else 200_000, sample_calls, rounds, cold)
    body = (
        "A training loop's calls on `ReplayBuffer`: appending transitions (5 fields) and `sample(256)` of "
        "whole transitions, against a numpy memmap of the same five fields (one `.npy` file each: the "
        "limit for a disk-backed store) and stable-baselines3's in-RAM `ReplayBuffer` (its `add` and its "
        "`sample`, which returns torch tensors). " + cold_steady_note(BLOCK, cold) + " Appends: blocks of "
        f"{APPEND_BLOCK:,} calls, each round on new, empty systems, rows/s = rows per call / steady time per "
        "call. Ratios: time per call over the baseline's (lower is better; below 1 trajstore is faster).\n\n"
        + tables(append, sample, opens, layouts) + "\n\n"
        "The compressor rows write the same random walk (continuous states compress little, like real "
        "observations); `size vs raw` is the store's stored bytes against its raw bytes.")
    return section("Core store (scripts/bench_core.py)", "bench_core.py", argv,
                   runs=f"every cold and steady figure is the median of {rounds} rounds, each on freshly created "
                        f"(append) or opened (sample) systems; extend rows/s: median of {rounds} writes; open: "
                        "median of 9 opens.",
                   body=body, quick=q, started=started, packages=("stable-baselines3", "torch"))


class MotoS3:
    """A moto S3 server on a free port of 127.0.0.1 with ``bucket`` created, until :meth:`stop`;
    ``options`` are s3fs ``storage_options`` for it (one request at a time per call:
    ``max_concurrency=1``).  Raises ImportError without moto[server] and boto3."""

    def __init__(self, bucket: str = "bench") -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint = endpoint = f"http://127.0.0.1:{port}"
        #: a boto3 client of the server (moto accepts any credentials)
        self.client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                                   aws_secret_access_key="bench", region_name="us-east-1")
        try:
            self.client.create_bucket(Bucket=bucket)
        except BaseException:
            self._server.stop()
            raise
        self.options: dict[str, Any] = {"key": "bench", "secret": "bench", "endpoint_url": endpoint,
                                         "max_concurrency": 1, "client_kwargs": {"region_name": "us-east-1"}}

    def stop(self) -> None:
        self._server.stop()



if __name__ == "__main__":
    print(main())
