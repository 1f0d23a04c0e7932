"""Push, pull and random batches of a versioned dataset on S3 (a moto server on 127.0.0.1; docs/versions.md).

Records a trajectory store of ROWS steps (obs 17 float32, action 6 float32, reward float32; episodes
of 1,000 steps, each with its return), then:

1. pushes it to ``icechunk+s3://`` (bytes uploaded), records one more episode and pushes again
   (the incremental push's bytes);
2. pulls 10% of the episodes (all fields, then ``obs`` only) and prints the bytes read as a share
   of the version's bytes (issue 33: at most 15%);
3. reads random batches of 256 steps straight from the icechunk repository and, next to it, from
   the same store copied to ``s3://`` (today's fsspec path): requests, bytes and ms per batch (each
   batch with cold chunk caches).

    python scripts/bench_versions.py                 # 1,000,000 rows
    python scripts/bench_versions.py --quick         # 20,000 rows
    python scripts/bench_versions.py --chunk-rows 16384   # one chunk of every field per 16,384 rows
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import tempfile
import time
import uuid
from typing import Any, Callable

import gymnasium as gym
import numpy as np

STEP = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (17,), np.float32),
                        "action": gym.spaces.Box(-1, 1, (6,), np.float32),
                        "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32)})
EPISODE = gym.spaces.Dict({"return": gym.spaces.Box(-np.inf, np.inf, (), np.float64)})
EPISODE_STEPS = 1000


def _moto() -> tuple[Any, dict[str, Any]]:
    from moto import server as moto_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="bench")
    return server, {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                    "client_kwargs": {"region_name": "us-east-1"}, "use_listings_cache": False, "max_concurrency": 1}


def _record(path: str, rows: int, chunk_rows: int | None) -> None:
    from trajstore import TrajectoryReplayBuffer

    kw = {} if chunk_rows is None else {"chunk_rows": chunk_rows,
                                        "step_episode_id_storage_kwargs": {"chunk_rows": chunk_rows}}
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=path, **kw)
    rng = np.random.default_rng(0)
    for e in range(rows // EPISODE_STEPS):
        reward = rng.standard_normal(EPISODE_STEPS).astype(np.float32)
        buf.extend({"obs": rng.standard_normal((EPISODE_STEPS, 17)).astype(np.float32),
                    "action": rng.uniform(-1, 1, (EPISODE_STEPS, 6)).astype(np.float32), "reward": reward})
        buf.set_current_episode_data({"return": float(reward.sum())})
        buf.mark_episode_end()
    buf.close()


def _batches(buf: Any, n: int, count: Callable[[], tuple[int, int]]) -> tuple[float, float, float]:
    """Mean (requests, bytes, ms) of ``n`` random batches of 256 steps, chunk caches dropped first."""
    rng = np.random.default_rng(1)
    reqs, nbytes, ms = [], [], []
    for _ in range(n):
        for f in buf._table.fields:  # (a script: cold caches for every batch)
            f.drop_cache()
        r0, b0 = count()
        t = time.perf_counter()
        buf.sample(256, rng=rng)
        ms.append((time.perf_counter() - t) * 1e3)
        r1, b1 = count()
        reqs.append(r1 - r0)
        nbytes.append(b1 - b0)
    return float(np.mean(reqs)), float(np.mean(nbytes)), float(np.median(ms))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--quick", action="store_true", help="20,000 rows")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--chunk-rows", type=int, default=None,
                   help="rows per chunk of every step field (default: about 1 MiB per chunk of each field)")
    args = p.parse_args()
    rows = 20_000 if args.quick else args.rows
    from zarr.storage import FsspecStore

    from trajstore import TrajectoryReplayBuffer
    from trajstore.core.store import Store
    from trajstore.maintenance.push_pull import pull, push

    server, opts = _moto()
    work = tempfile.mkdtemp(prefix="bench_versions_")
    try:
        local = os.path.join(work, "local")
        _record(local, rows, args.chunk_rows)
        remote = f"icechunk+s3://bench/{uuid.uuid4().hex}"
        t = time.perf_counter()
        first = push(local, remote, tag="v1", remote_options=opts, progress=False)
        print(f"push v1: {first['uploaded_bytes'] / 1e6:.1f} MB in {first['uploaded']} keys, "
              f"{time.perf_counter() - t:.1f} s")
        buf = TrajectoryReplayBuffer.load_from(local)
        buf.extend({"obs": np.zeros((EPISODE_STEPS, 17), np.float32), "action": np.zeros((EPISODE_STEPS, 6), np.float32),
                    "reward": np.zeros(EPISODE_STEPS, np.float32)})
        buf.mark_episode_end()
        buf.close()
        second = push(local, remote, tag="v2", remote_options=opts, progress=False)
        print(f"push v2 (one more episode): {second['uploaded_bytes'] / 1e6:.2f} MB in {second['uploaded']} of "
              f"{second['keys']} keys")
        episodes = rows // EPISODE_STEPS
        for fields in (None, ["obs"]):
            out = os.path.join(work, f"pulled-{fields}")
            t = time.perf_counter()
            got = pull(f"{remote}@v1", out, episodes=(0, episodes // 10), fields=fields, storage_options=opts,
                       progress=False)
            print(f"pull 10% of episodes, fields {fields or 'all'}: read {got['bytes_read'] / 1e6:.1f} of "
                  f"{got['remote_bytes'] / 1e6:.1f} MB = {got['bytes_read'] / got['remote_bytes']:.1%} in "
                  f"{got['requests']} requests, {time.perf_counter() - t:.1f} s")

        ice = TrajectoryReplayBuffer.load_from(remote, read_only=True, storage_options=opts)
        store = ice.location.transaction.zstore
        r, b, ms = _batches(ice, args.batches, lambda: (store.requests, store.bytes_read))
        print(f"random batch of 256 from icechunk on moto: {r:.0f} requests, {b / 1e6:.2f} MB, {ms:.0f} ms")
        ice.close()
        plain = f"s3://bench/{uuid.uuid4().hex}"
        source = Store.open(local, None, read_only=True, multiprocessing=False, storage_options=None, options={})
        source.copy_to(plain, storage_options=opts)  # the same store on today's fsspec path
        source.close()
        counts = [0, 0]
        orig = FsspecStore.get

        async def counting(self, key, prototype, byte_range=None):  # type: ignore[no-untyped-def]
            out = await orig(self, key, prototype, byte_range)
            if out is not None:
                counts[0] += 1
                counts[1] += len(out)
            return out

        FsspecStore.get = counting  # type: ignore[method-assign]
        fs = TrajectoryReplayBuffer.load_from(plain, read_only=True, storage_options=opts)
        r, b, ms = _batches(fs, args.batches, lambda: (counts[0], counts[1]))
        print(f"random batch of 256 from s3:// (fsspec) on moto: {r:.0f} requests, {b / 1e6:.2f} MB, {ms:.0f} ms")
        fs.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()


if __name__ == "__main__":
    main()
