"""Core store benchmark: append throughput and sample(256), as ratios against baselines run in
the same process (a numpy memmap of the same data; stable-baselines3's in-RAM ReplayBuffer
when installed).

    python scripts/bench_core.py                 # full sizes: 1e6 x (17,) f32, 1e5 x (84,84,4) u8
    python scripts/bench_core.py --quick         # small sizes (smoke test)
    python scripts/bench_core.py --markdown docs/benchmarks.md   # also (re)write the "Core" section

Times are medians over repeats; page cache warm.  A ratio < 1 means trajstore is faster.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from trajstore import ReplayBuffer


#: Consecutive calls of one system before the next system's turn, and the calls after opening
#: that count as cold (the process's mappings of a freshly opened store not yet faulted in).
BLOCK, COLD = 25, 200


def run_blocks(systems: dict[str, Callable[[], Any]], calls: int, block: int = BLOCK) -> dict[str, np.ndarray]:
    """Seconds of each of ``calls`` consecutive calls per system, in blocks of ``block`` calls, the
    systems' order rotated every round (neither gets the process's warm-up for free; blocks, not
    single calls interleaved, are how a training loop calls)."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(-(-calls // block)):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, out = systems[name], times[name]
            for _ in range(block):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
    return {n: np.asarray(ts[:calls]) for n, ts in times.items()}


def _median_time(fn: Callable[[], Any], repeats: int, inner: int, warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` rounds of ``inner`` calls, after
    ``warmup`` calls (random reads of a fresh mapping first fault its pages in)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t) / inner)
    return statistics.median(times)


def _transition_space(obs_shape: tuple[int, ...], obs_dtype: Any) -> gym.spaces.Dict:
    lo, hi = (0, 255) if obs_dtype == np.uint8 else (-np.inf, np.inf)
    obs = gym.spaces.Box(lo, hi, obs_shape, obs_dtype)
    return gym.spaces.Dict({
        "obs": obs, "next_obs": obs, "action": gym.spaces.Box(-1, 1, (6,), np.float32),
        "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32), "done": gym.spaces.Box(0, 1, (), np.float32),
    })


def _sb3_buffer(n: int, obs_shape: tuple[int, ...], obs_dtype: Any) -> Any:
    try:
        from stable_baselines3.common.buffers import ReplayBuffer as SB3ReplayBuffer
    except ImportError:
        return None
    lo, hi = (0, 255) if obs_dtype == np.uint8 else (-np.inf, np.inf)
    return SB3ReplayBuffer(n, gym.spaces.Box(lo, hi, obs_shape, obs_dtype), gym.spaces.Box(-1, 1, (6,), np.float32),
                           device="cpu", n_envs=1, handle_timeout_termination=False)


def bench_append(tmp: Path, n: int, obs_shape: tuple[int, ...], obs_dtype: Any, label: str) -> list[dict[str, Any]]:
    """Per-transition append (obs, next_obs, action, reward, done) against a memmap and SB3's add."""
    rng = np.random.default_rng(0)
    obs = (rng.integers(0, 255, (256, *obs_shape)) if obs_dtype == np.uint8 else rng.standard_normal((256, *obs_shape))).astype(obs_dtype)
    act = rng.uniform(-1, 1, (256, 6)).astype(np.float32)
    rows = []
    for batch in (1, 8, 64):
        steps = max(n // batch, 1) * batch
        slug = f"{obs_dtype.__name__}_{batch}"
        rb = ReplayBuffer.create(_transition_space(obs_shape, obs_dtype), cache_path=tmp / f"app_{slug}", overwrite=True)

        def ours() -> None:
            if batch == 1:
                for i in range(steps):
                    j = i & 255
                    rb.append({"obs": obs[j], "next_obs": obs[j], "action": act[j], "reward": np.float32(1.0), "done": np.float32(0.0)})
            else:
                for i in range(0, steps, batch):
                    j = i & 255 if (i & 255) + batch <= 256 else 0
                    rb.extend({"obs": obs[j:j + batch], "next_obs": obs[j:j + batch], "action": act[j:j + batch],
                               "reward": np.ones(batch, np.float32), "done": np.zeros(batch, np.float32)})
            rb.flush()

        t0 = time.perf_counter()
        ours()
        t_ours = time.perf_counter() - t0
        rb.close()

        mm_path = tmp / f"mm_{slug}"
        arrays = {k: np.lib.format.open_memmap(str(mm_path) + k + ".npy", mode="w+", dtype=d, shape=(steps, *s))
                  for k, d, s in (("obs", obs_dtype, obs_shape), ("next_obs", obs_dtype, obs_shape),
                                  ("action", np.float32, (6,)), ("reward", np.float32, ()), ("done", np.float32, ()))}
        t0 = time.perf_counter()
        for i in range(0, steps, batch):
            j = i & 255 if (i & 255) + batch <= 256 else 0
            arrays["obs"][i:i + batch] = obs[j:j + batch]
            arrays["next_obs"][i:i + batch] = obs[j:j + batch]
            arrays["action"][i:i + batch] = act[j:j + batch]
            arrays["reward"][i:i + batch] = 1.0
            arrays["done"][i:i + batch] = 0.0
        for a in arrays.values():
            a.flush()
        t_mm = time.perf_counter() - t0
        del arrays

        row = {"what": f"append {label}, batch {batch}", "ours": steps / t_ours, "memmap": steps / t_mm, "unit": "steps/s"}
        if batch == 1:
            sb3 = _sb3_buffer(steps, obs_shape, obs_dtype)
            if sb3 is not None:
                t0 = time.perf_counter()
                for i in range(steps):
                    j = i & 255
                    sb3.add(obs[j:j + 1], obs[j:j + 1], act[j:j + 1], np.ones(1, np.float32), np.zeros(1, np.float32), [{}])
                row["sb3"] = steps / (time.perf_counter() - t0)
                del sb3
        rows.append(row)
    return rows


def bench_sample(tmp: Path, n: int, obs_shape: tuple[int, ...], obs_dtype: Any, label: str, repeats: int) -> list[dict[str, Any]]:
    """sample(256) of a single obs field and of whole transitions, against memmap and SB3."""
    rng = np.random.default_rng(1)
    space = _transition_space(obs_shape, obs_dtype)
    path = tmp / ("smp_vec" if obs_dtype != np.uint8 else "smp_img")
    rb = ReplayBuffer.create(space, cache_path=path, overwrite=True)
    # The baseline holds the same five fields as numpy memmaps (one .npy file each).
    mms = {k: np.lib.format.open_memmap(f"{path}.{k}.npy", mode="w+", dtype=d, shape=(n, *s))
           for k, d, s in (("obs", obs_dtype, obs_shape), ("next_obs", obs_dtype, obs_shape),
                           ("action", np.float32, (6,)), ("reward", np.float32, ()), ("done", np.float32, ()))}
    mm = mms["obs"]
    sb3 = _sb3_buffer(n, obs_shape, obs_dtype)
    block = 4096
    for lo in range(0, n, block):
        hi = min(lo + block, n)
        o = (rng.integers(0, 255, (hi - lo, *obs_shape)) if obs_dtype == np.uint8 else rng.standard_normal((hi - lo, *obs_shape))).astype(obs_dtype)
        a = rng.uniform(-1, 1, (hi - lo, 6)).astype(np.float32)
        rb.extend({"obs": o, "next_obs": o, "action": a, "reward": np.ones(hi - lo, np.float32), "done": np.zeros(hi - lo, np.float32)})
        mms["obs"][lo:hi] = mms["next_obs"][lo:hi] = o
        mms["action"][lo:hi] = a
        mms["reward"][lo:hi] = 1.0
        if sb3 is not None:
            sb3.observations[lo:hi, 0] = o
            sb3.next_observations[lo:hi, 0] = o
            sb3.actions[lo:hi, 0] = a
            sb3.rewards[lo:hi, 0] = 1.0
    rb.close()
    for m in mms.values():
        m.flush()
    # Fresh read-only mappings for the baseline too, so both sides start with cold mappings.
    mms = {k: np.load(f"{path}.{k}.npy", mmap_mode="r") for k in mms}
    mm = mms["obs"]
    if sb3 is not None:
        sb3.pos, sb3.full = 0, True
    ro = ReplayBuffer.load_from(path, read_only=True)
    obs_only = ro.get_column(["obs"])
    inner = 200 if obs_dtype != np.uint8 else 20
    warm = min(3000, max(10, 3 * n // 256))  # enough random batches to touch (nearly) every row once

    def mm_gather() -> Any:
        return mm[rng.integers(0, n, 256)]

    def mm_gather_all() -> Any:
        idx = rng.integers(0, n, 256)
        return {k: m[idx] for k, m in mms.items()}

    def ours_obs() -> Any:
        return obs_only[rng.integers(0, n, 256)]

    t_mm = _median_time(mm_gather, repeats, inner, warm)
    t_mm_all = _median_time(mm_gather_all, repeats, inner, warm)
    t_obs = _median_time(ours_obs, repeats, inner, warm)
    t_tr = _median_time(lambda: ro.sample(256, rng=rng), repeats, inner, warm)
    rows = [
        {"what": f"rows 256 random obs {label} (column view)", "ours": t_obs * 1e3, "memmap": t_mm * 1e3, "unit": "ms"},
        {"what": f"sample(256) transitions {label}", "ours": t_tr * 1e3, "memmap": t_mm_all * 1e3, "unit": "ms"},
    ]
    if sb3 is not None:
        rt = ReplayBuffer.load_from(path, read_only=True, backend="torch")
        rows.append({"what": f"sample(256) transitions {label}, torch",
                     "ours": _median_time(lambda: rt.sample(256, rng=rng), repeats, inner, warm) * 1e3,
                     "sb3": _median_time(lambda: sb3.sample(256), repeats, inner, warm) * 1e3, "unit": "ms"})
        rt.close()
    ro.close()
    return rows


def bench_layouts(tmp: Path, n: int, repeats: int) -> list[dict[str, Any]]:
    """The storage-option defaults: sample(256) and disk use of (17,) f32 rows per compressor."""
    from trajstore.maintenance.summary import store_info

    rng = np.random.default_rng(3)
    # A random walk: continuous states compress little (about 1.25x), like real observations.
    data = np.cumsum(rng.standard_normal((n, 17)).astype(np.float32) * 0.01, axis=0)
    rows = []
    for comp in (None, "lz4", "zstd"):
        path = tmp / f"layout_{comp}"
        rb = ReplayBuffer.create(gym.spaces.Box(-np.inf, np.inf, (17,), np.float32), cache_path=path, compressor=comp)
        t0 = time.perf_counter()
        for lo in range(0, n, 8192):
            rb.extend(data[lo:lo + 8192])
        rb.close()
        t_write = time.perf_counter() - t0
        ro = ReplayBuffer.load_from(path, read_only=True)
        t = _median_time(lambda: ro.sample(256, rng=rng), repeats, 50, 20)
        ro.close()
        info = store_info(path)
        ratio = info["compression_ratio"]  # None for raw stores (no compression to report)
        rows.append({"what": f"layout compressor={comp}: sample(256) (17,) f32 [ratio "
                             f"{'raw' if ratio is None else f'{ratio:.2f}x'}, "
                             f"extend {n / t_write:,.0f} rows/s]", "ours": t * 1e3, "unit": "ms"})
    return rows


def bench_open(tmp: Path, n: int) -> list[dict[str, Any]]:
    """load_from and dumps-to-own-path cost on the vector store (metadata only)."""
    path = tmp / "smp_vec"
    t_load = _median_time(lambda: ReplayBuffer.load_from(path, read_only=True).close(), 5, 5)
    rb = ReplayBuffer.load_from(path)
    t_dump = _median_time(rb.dumps, 5, 5)
    rb.close()
    return [{"what": f"load_from (read-only), {n:,} rows", "ours": t_load * 1e3, "unit": "ms"},
            {"what": f"dumps() to own path, {n:,} rows", "ours": t_dump * 1e3, "unit": "ms"}]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 1000 else f"{v:.3g}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| measurement | unit | trajstore | numpy memmap | ratio vs memmap | SB3 | ratio vs SB3 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ours, mm, sb3 = r.get("ours"), r.get("memmap"), r.get("sb3")
        # For throughput, ratio = baseline rate / ours (how many times slower we are); for times, ours / baseline.
        def ratio(base: Any) -> str:
            if base is None or ours is None:
                return "-"
            return f"{(base / ours if r['unit'] == 'steps/s' else ours / base):.2f}x"
        lines.append(f"| {r['what']} | {r['unit']} | {_fmt(ours)} | {_fmt(mm)} | {ratio(mm)} | {_fmt(sb3)} | {ratio(sb3)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--vec-rows", type=int, default=1_000_000)
    p.add_argument("--img-rows", type=int, default=100_000)
    p.add_argument("--markdown", type=Path, default=None, help="write the results into this markdown file's Core section")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.vec_rows, args.img_rows = 20_000, 2_000
    repeats = 3 if args.quick else 9
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        tmp = Path(d)
        rows = []
        rows += bench_append(tmp, min(args.vec_rows, 200_000), (17,), np.float32, "(17,) f32")
        rows += bench_append(tmp, min(args.img_rows, 20_000), (84, 84, 4), np.uint8, "(84,84,4) u8")
        rows += bench_sample(tmp, args.vec_rows, (17,), np.float32, "(17,) f32", repeats)
        rows += bench_sample(tmp, args.img_rows, (84, 84, 4), np.uint8, "(84,84,4) u8", repeats)
        rows += bench_open(tmp, args.vec_rows)
        rows += bench_layouts(tmp, min(args.vec_rows, 200_000), repeats)
    text = table(rows)
    print(text)
    if args.markdown:
        cmd, env = _reproduce("bench_core.py", args.quick, f"numpy {np.__version__}")
        section = (f"## Core store (scripts/bench_core.py)\n\nReproduce: `{cmd}` ({env}; {args.vec_rows:,} vector rows, "
                   f"{args.img_rows:,} image rows; medians, page cache warm). Append rows: steps/s, higher is better, the "
                   f"ratio is how many times slower trajstore is. Read rows: ms per call, lower is better.\n\n{text}\n")
        _replace_section(args.markdown, "## Core store", section)
    return 0


def _reproduce(script: str, quick: bool, versions: str) -> tuple[str, str]:
    """The command that rewrites a benchmark's section, and a description of this machine
    (``versions``: the libraries that matter, e.g. ``"numpy 2.4.6"``)."""
    cmd = f"python scripts/{script} --markdown docs/benchmarks.md" + (" --quick" if quick else "")
    return cmd, f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, {versions}"


def _replace_section(path: Path, heading: str, section: str) -> None:
    """Replace the markdown section starting at ``heading`` (up to the next ``## ``) or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery number here comes from a script under scripts/, run on this project's 2-core machine.\n\n"
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        # The section ends at the next heading or marker comment (another script's delimited section).
        ends = [e for e in (text.find("\n## ", start + len(heading)), text.find("\n<!-- ", start + len(heading)))
                if e >= 0]
        end = min(ends) if ends else -1
        text = text[:start] + section + (text[end + 1:] if end >= 0 else "")
    path.write_text(text)


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


def _write_markdown(path: Path, script: str, quick: bool, heading: str, text: str) -> None:
    """Replace the section ``heading`` of ``path`` with ``text``, under the command that rewrites
    it and this machine's description (numpy and zarr versions)."""
    import zarr

    cmd, machine = _reproduce(script, quick, f"numpy {np.__version__}, zarr {zarr.__version__}")
    _replace_section(path, heading, f"{heading}\n\n`{cmd}` ({machine})\n\n{text}\n")


if __name__ == "__main__":
    sys.exit(main())
