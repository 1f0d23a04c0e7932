"""Ray actors recording CartPole into shards of one dataset while a learner samples it (issue 17).

    python scripts/ray_actors.py --actors 2 --steps 2000 DIR        # actors write DIR, this process samples it
    python scripts/ray_actors.py --quick DIR                        # small (the docs tests run this)

A local Ray cluster (127.0.0.1, ``--cpus`` CPUs, no dashboard, no usage report) is started unless
``--address`` names a running one (``auto``: the cluster ``ray start`` made on this machine).

Throughput with 1, 2 and 4 actors against one recorder in this process: scripts/bench_ray.py
(it uses :func:`measure` and :func:`table` below).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_core import COLD, run_blocks  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine

import ray  # noqa: E402

import trajstore.ray as tray  # noqa: E402
from trajstore.recording import EPISODE_SPACE, RecordEpisodes, step_space  # noqa: E402
from trajstore.shards import create_shard, open_sharded  # noqa: E402

ENV = functools.partial(gym.make, "CartPole-v1")


def _cold_steady(stats: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean µs per step over the first ``COLD_STEPS`` steps of each actor, and over the rest."""
    cold = [min(s["steps"], tray.COLD_STEPS) for s in stats]
    steady = sum(s["steps"] for s in stats) - sum(cold)
    return (sum(s["cold_seconds"] for s in stats) / sum(cold) * 1e6,
            sum(s["steady_seconds"] for s in stats) / steady * 1e6 if steady else float("nan"))


def learn(root: str, actors: int, steps: int, flush_every: int, storage_options: dict[str, Any] | None) -> None:
    """Actors collect while this process samples the growing dataset; then print what it holds."""
    handles = tray.start_actors(root, ENV, actors, flush_every=flush_every, storage_options=storage_options)
    try:
        ray.get([a.stats.remote() for a in handles])  # every shard exists
        data = open_sharded(root, storage_options=storage_options)
        t0 = time.perf_counter()
        refs = [a.collect.remote(steps) for a in handles]
        rng, batches, batch = np.random.default_rng(0), 0, None
        while ray.wait(refs, num_returns=len(refs), timeout=0.2)[1]:
            if len(data) >= 256:
                batch = data.sample(256, rng=rng)  # a learner's training step would use this
                batches += 1
            print(f"  {time.perf_counter() - t0:6.2f} s: {len(data):7,} committed steps in {len(data.shards['shard'])} shards")
        stats = ray.get(refs)
        wall = time.perf_counter() - t0
        ray.get([a.close.remote() for a in handles])
    finally:
        for a in handles:
            ray.kill(a)
    data.refresh()
    episodes = data.episodes()
    print(f"{len(data):,} steps, {len(episodes['episode_id']):,} episodes in shards "
          f"{', '.join(data.shards['shard'])}; {sum(s['rows'] for s in stats) / wall:,.0f} committed steps/s; "
          f"the learner sampled {batches} batches of 256 while they wrote"
          + (f"; last batch obs {batch['step_data']['obs'].shape}" if batch is not None else " (they finished first)"))
    assert len(data) == sum(s["rows"] for s in stats)
    data.close()


def _in_process(root: str, steps: int, flush_every: int) -> dict[str, Any]:
    """One recorder in this process (no Ray): steps/s as ShardWriter.collect runs them, and a recorded
    step against a bare env step in blocks of consecutive steps."""
    writer = tray.ShardWriter(root, ENV, seed=0, flush_every=flush_every)
    res = writer.collect(steps)
    writer.close()
    bare, rec_env = ENV(), ENV()
    rec = RecordEpisodes(rec_env, create_shard(root, step_space(rec_env.observation_space, rec_env.action_space,
                                                                next_obs=True),
                                               episode_data_instance_space=EPISODE_SPACE), record_next_obs=True)
    bare.action_space.seed(0)
    state = {"bare": True, "rec": True, "n": 0}

    def step_bare() -> None:
        if state["bare"]:
            bare.reset(seed=0)
        _, _, term, trunc, _ = bare.step(bare.action_space.sample())
        state["bare"] = term or trunc

    def step_recorded() -> None:
        if state["rec"]:
            rec.reset(seed=0)
        _, _, term, trunc, _ = rec.step(rec.action_space.sample())
        state["rec"] = term or trunc
        state["n"] += 1
        if state["n"] % flush_every == 0:
            rec.buffer.flush()  # type: ignore[union-attr]

    times = run_blocks({"bare env step": step_bare, "recorded step": step_recorded}, steps)
    rec.close()
    rec.buffer.close()  # type: ignore[union-attr]
    return {"steps_per_s": steps / res["seconds"], "cold_steady": _cold_steady([res]), "blocks": times}


def measure(root: str, counts: list[int], steps: int, flush_every: int) -> dict[str, Any]:
    """One run: the in-process recorder, then ``counts`` actors each (Ray must be initialised).

    Returns ``{"base": {"steps_per_s", "cold", "steady", "recorded_us", "bare_us"}, "actors": {n:
    {"steps_per_s", "cold", "steady"}}}``: committed steps per second, µs per step cold and steady,
    and (in-process) a recorded step against a bare env step, steady µs."""
    base = _in_process(os.path.join(root, "in-process"), steps, flush_every)
    b = base["blocks"]
    cold, steady = base["cold_steady"]
    out: dict[str, Any] = {"base": {"steps_per_s": base["steps_per_s"], "cold": cold, "steady": steady,
                                    "recorded_us": b["recorded step"][COLD:].mean() * 1e6,
                                    "bare_us": b["bare env step"][COLD:].mean() * 1e6}, "actors": {}}
    for n in counts:
        handles = tray.start_actors(os.path.join(root, f"actors-{n}"), ENV, n, flush_every=flush_every)
        try:
            ray.get([a.stats.remote() for a in handles])  # start-up (shard creation) is not counted
            t0 = time.perf_counter()
            stats = ray.get([a.collect.remote(steps) for a in handles])
            wall = time.perf_counter() - t0
            ray.get([a.close.remote() for a in handles])
        finally:
            for a in handles:
                ray.kill(a)
        cold, steady = _cold_steady(stats)
        out["actors"][n] = {"steps_per_s": sum(s["rows"] for s in stats) / wall, "cold": cold, "steady": steady}
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """The throughput table (markdown) of :func:`measure` runs: medians over the runs, each
    actor count's ratio taken against its own run's in-process rate before the median."""
    med = statistics.median
    base = [r["base"] for r in runs]
    rate0 = med(b["steps_per_s"] for b in base)
    lines = ["| actors | committed steps/s (all actors) | per actor | ratio to 1 recorder in-process | "
             "µs/step cold | µs/step steady |", "|---|---|---|---|---|---|",
             f"| in-process, no Ray | {rate0:,.0f} | {rate0:,.0f} | 1.00 | {med(b['cold'] for b in base):,.0f} | "
             f"{med(b['steady'] for b in base):,.0f} |"]
    for n in runs[0]["actors"]:
        got = [r["actors"][n] for r in runs]
        rate = med(g["steps_per_s"] for g in got)
        ratio = med(r["actors"][n]["steps_per_s"] / r["base"]["steps_per_s"] for r in runs)
        lines.append(f"| {n} | {rate:,.0f} | {rate / n:,.0f} | {ratio:.2f} | {med(g['cold'] for g in got):,.0f} | "
                     f"{med(g['steady'] for g in got):,.0f} |")
    rec, bare = med(b["recorded_us"] for b in base), med(b["bare_us"] for b in base)
    lines += ["", f"A recorded step (steady, in-process): {rec:.0f} µs against {bare:.0f} µs for a bare CartPole "
              f"step ({rec / bare:.1f}x)."]
    return "\n".join(lines)


def start_local_ray(cpus: int, address: str = "local") -> None:
    """``ray.init`` of a local cluster on 127.0.0.1 (``cpus`` CPUs, no dashboard, quiet), or of
    the running cluster at ``address``."""
    ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False,
             **({"num_cpus": cpus, "_node_ip_address": "127.0.0.1"} if address == "local" else {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="dataset root (created; an existing one gets new shards)")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--steps", type=int, default=2000, help="env steps per actor")
    p.add_argument("--flush-every", type=int, default=500, help="steps between an actor's commits")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument("--address", default="local", help="'local' (start one) or a running cluster's address ('auto')")
    p.add_argument("--storage-options", type=json.loads, default=None,
                   help="fsspec settings for a URL root, JSON, no secrets (e.g. '{\"profile\": \"actors\"}')")
    p.add_argument("--quick", action="store_true", help="small: 300 steps per actor, flush every 100")
    args = p.parse_args()
    if args.quick:
        args.steps, args.flush_every = min(args.steps, 300), min(args.flush_every, 100)
    start_local_ray(args.cpus, args.address)
    try:
        root = args.dir if "://" in args.dir else os.path.abspath(args.dir)  # actors run in other folders
        learn(root, args.actors, args.steps, args.flush_every, args.storage_options)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
