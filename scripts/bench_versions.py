"""Push, pull and random batches of a versioned dataset on S3 (a moto server on 127.0.0.1; docs/versions.md).

Records a trajectory store of ROWS steps (obs 17 float32, action 6 float32, reward float32; episodes
of 1,000 steps, each with its return), then:

1. pushes it to ``icechunk+s3://`` (bytes uploaded), records one more episode and pushes again
   (the incremental push's bytes);
2. pulls 10% of the episodes (all fields, then ``obs`` only) and prints the bytes read as a share
   of the version's bytes (issue 33: at most 15%);
3. reads random batches of 256 steps straight from the icechunk repository and, next to it, from
   the same store copied to ``s3://`` (today's fsspec path): requests, bytes and ms per batch (each
   batch with cold chunk caches);
4. (``--commits N``, default 200) makes a repository of N commits (one 100-step episode each, on
   local disk) and times ``trajstore log`` and ``trajstore diff`` of its first and last commits.

Bytes read are counted where trajstore's reads reach icechunk (every get of the repository's
store, with the byte ranges icechunk fetched), plus, at the S3 level, the body bytes of the GET
responses moto served during the pull (icechunk's own snapshot and manifest reads included).

    python scripts/bench_versions.py                 # 1,000,000 rows
    python scripts/bench_versions.py --quick         # 20,000 rows
    python scripts/bench_versions.py --chunk-rows 16384   # one chunk of every field per 16,384 rows
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import section  # noqa: E402

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


class _CountingProxy:
    """A TCP proxy in front of the moto server counting the bytes it sends back (responses: the
    S3 level's view of what a client transferred), for the pull's options only."""

    def __init__(self, endpoint: str) -> None:
        import threading

        host, port = endpoint.rsplit("//", 1)[1].split(":")
        self.target = (host, int(port))
        self.down = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    with self.lock:
                        self.down += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _pushes(local: str, remote: str, opts: dict[str, Any]) -> None:
    from trajstore import TrajectoryReplayBuffer
    from trajstore.maintenance.push_pull import push

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


def _pulls(work: str, remote: str, opts: dict[str, Any], episodes: int) -> None:
    """Pull 10% of the episodes of v1 (all fields, then obs only), through the counting proxy; then
    time sample(256) on the pulled store and on the local store it came from (same tables)."""
    from trajstore import TrajectoryReplayBuffer
    from trajstore.maintenance.push_pull import pull

    proxy = _CountingProxy(opts["endpoint_url"])
    try:
        for fields in (None, ["obs"]):
            out = os.path.join(work, f"pulled-{fields}")
            down0 = proxy.down
            t = time.perf_counter()
            got = pull(f"{remote}@v1", out, episodes=(0, episodes // 10), fields=fields,
                       storage_options={**opts, "endpoint_url": proxy.endpoint}, progress=False)
            total = got["remote_bytes"]
            print(f"pull 10% of episodes, fields {fields or 'all'}: trajstore read {got['bytes_read'] / 1e6:.2f} of "
                  f"{total / 1e6:.2f} MB = {got['bytes_read'] / total:.1%} in {got['requests']} requests; S3 sent "
                  f"{(proxy.down - down0) / 1e6:.2f} MB = {(proxy.down - down0) / total:.1%} (HTTP, icechunk's "
                  f"metadata included); {time.perf_counter() - t:.1f} s")
    finally:
        proxy.close()
    for path, name in ((os.path.join(work, "pulled-None"), "pulled store"), (os.path.join(work, "local"), "local store")):
        buf = TrajectoryReplayBuffer.load_from(path, read_only=True)
        rng = np.random.default_rng(2)
        buf.sample(256, rng=rng)
        t = time.perf_counter()
        for _ in range(200):
            buf.sample(256, rng=rng)
        print(f"sample(256) on the {name} ({len(buf)} steps): {(time.perf_counter() - t) / 200 * 1e3:.3f} ms")
        buf.close()


def _random_batches(work: str, local: str, remote: str, opts: dict[str, Any], n: int) -> None:
    from zarr.storage import FsspecStore

    from trajstore import TrajectoryReplayBuffer
    from trajstore.core.store import Store

    ice = TrajectoryReplayBuffer.load_from(remote, read_only=True, storage_options=opts)
    store = ice.location.transaction.zstore
    r, b, ms = _batches(ice, n, lambda: (store.requests, store.bytes_read))
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
    try:
        fs = TrajectoryReplayBuffer.load_from(plain, read_only=True, storage_options=opts)
        r, b, ms = _batches(fs, n, lambda: (counts[0], counts[1]))
        print(f"random batch of 256 from s3:// (fsspec) on moto: {r:.0f} requests, {b / 1e6:.2f} MB, {ms:.0f} ms")
        fs.close()
    finally:
        FsspecStore.get = orig  # type: ignore[method-assign]


def _log_and_diff(work: str, commits: int) -> None:
    """A local repository of ``commits`` commits (one 100-step episode each): log and diff timed."""
    from trajstore import TrajectoryReplayBuffer
    from trajstore.maintenance.versions import diff, log

    url = f"icechunk://{os.path.join(work, 'many')}"
    buf = TrajectoryReplayBuffer.create(STEP, episode_data_instance_space=EPISODE, cache_path=url, commit_interval=3600)
    rng = np.random.default_rng(3)
    t = time.perf_counter()
    for _ in range(commits):
        buf.extend({"obs": rng.standard_normal((100, 17)).astype(np.float32),
                    "action": rng.uniform(-1, 1, (100, 6)).astype(np.float32),
                    "reward": np.ones(100, np.float32)})
        buf.set_current_episode_data({"return": 100.0})
        buf.mark_episode_end()
        buf.flush()
    buf.close()
    print(f"{commits} commits of one 100-step episode each (local icechunk): {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    entries = log(url)
    print(f"trajstore log ({len(entries)} commits): {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    d = diff(url, entries[-1]["snapshot"], entries[0]["snapshot"])
    print(f"trajstore diff first..last ({len(d['episodes']['added'])} episodes added): "
          f"{time.perf_counter() - t:.2f} s")


def main(argv: list[str] | None = None) -> str:
    """Run the parts asked for and return the docs/benchmarks.md section (each printed figure, one
    bullet each, as scripts/bench_all.py collects it)."""
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--quick", action="store_true", help="20,000 rows")
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--chunk-rows", type=int, default=None,
                   help="rows per chunk of every step field (default: about 2 MiB per raw chunk of each field)")
    p.add_argument("--commits", type=int, default=200, help="commits of the repository log/diff are timed on")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: pull,batches,log")
    args = p.parse_args(argv)
    rows = 20_000 if args.quick else args.rows
    commits = 20 if args.quick else args.commits
    skip = set(filter(None, args.skip.split(",")))

    printed = io.StringIO()
    server, opts = _moto()
    work = tempfile.mkdtemp(prefix="bench_versions_")
    try:
        with contextlib.redirect_stdout(printed):
            local = os.path.join(work, "local")
            remote = f"icechunk+s3://bench/{uuid.uuid4().hex}"
            if not {"pull", "batches"} <= skip:
                _record(local, rows, args.chunk_rows)
                _pushes(local, remote, opts)
            if "pull" not in skip:
                _pulls(work, remote, opts, rows // EPISODE_STEPS)
            if "batches" not in skip:
                _random_batches(work, local, remote, opts, args.batches)
            if "log" not in skip:
                _log_and_diff(work, commits)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        server.stop()
    chunks = f"chunks of {args.chunk_rows:,} rows" if args.chunk_rows else "default chunking (about 2 MiB per raw chunk)"
    body = (f"A trajectory store of {rows:,} steps (obs (17,) f32, action (6,) f32, reward f32; episodes of "
            f"{EPISODE_STEPS:,} steps, {chunks}) pushed to an icechunk repository on a moto S3 server on 127.0.0.1, "
            "pulled in part (10% of the episodes; target: at most 15% of the version's bytes), read at random "
            "straight from the repository next to the same store on today's fsspec path (each batch with cold "
            f"chunk caches), and a local repository of {commits} commits for `trajstore log` / `diff`. "
            "Each line below is one measurement as the script printed it.\n\n"
            + "\n".join(f"- {line}" for line in printed.getvalue().splitlines() if line.strip()))
    return section("Versions on icechunk (scripts/bench_versions.py)", "bench_versions.py", argv,
                   runs=f"one run per figure; random batches: mean of {args.batches} cold batches; sample(256): "
                        "mean of 200 calls after one.",
                   body=body, quick=args.quick, started=started, packages=("icechunk", "moto"))


if __name__ == "__main__":
    print(main())
