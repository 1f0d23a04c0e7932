"""Ray actors recording into shards of one dataset: committed steps per second with 1, 2 and 4
actors against one recorder in this process, as the "Ray actors" section of docs/benchmarks.md.

    python scripts/bench_ray.py               # 1, 2 and 4 actors, 20,000 CartPole steps each, 3 runs
    python scripts/bench_ray.py --quick       # 1 actor, 300 steps, 1 run (a smoke test)

Each run: one recorder in this process (no Ray; ``ray_actors._in_process``) records the steps
first, then for each actor count a fresh set of actors on a local Ray cluster (``--cpus`` CPUs,
127.0.0.1) records ``--steps`` steps each (scripts/ray_actors.py: ``measure``).  The ratio of a
count is taken against the in-process rate of its own run, then the median over runs.

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray_actors as RA  # noqa: E402
from benchdoc import section  # noqa: E402


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; the markdown section for docs/benchmarks.md."""
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 actor, 300 steps, 1 run (a smoke test)")
    ap.add_argument("--actors", default="1,2,4", help="actor counts (default 1,2,4)")
    ap.add_argument("--steps", type=int, default=20_000, help="CartPole steps per actor (default 20,000)")
    ap.add_argument("--flush-every", type=int, default=500, help="steps between an actor's commits (default 500)")
    ap.add_argument("--runs", type=int, default=3, help="runs behind each median (default 3)")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (default 2)")
    a = ap.parse_args(argv)
    counts = [int(n) for n in a.actors.split(",")]
    steps, flush, runs = a.steps, a.flush_every, a.runs
    if a.quick:
        counts, steps, flush, runs = counts[:1], min(steps, 300), min(flush, 100), 1
    RA.start_local_ray(a.cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_ray_") as tmp:
            results = [RA.measure(str(Path(tmp) / f"run{r}"), counts, steps, flush) for r in range(runs)]
        version = RA.ray.__version__
    finally:
        RA.ray.shutdown()
    body = (f"{steps:,} CartPole-v1 steps (random actions) per actor, a commit every {flush} steps, actors on a "
            f"local Ray {version} cluster of {a.cpus} CPUs on this machine. Committed steps per second across all "
            "actors, from their `collect` calls starting to the last one's final commit (actor start-up excluded), "
            "and as a ratio to one recorder in this process without Ray that recorded the same steps first in the "
            "same run. Per-step times: cold is the mean of the first 200 steps after a shard was created, steady of "
            "the rest. On a cluster each actor brings its own cores; here the actors share two.\n\n"
            + RA.table(results))
    return section("Ray actors (scripts/bench_ray.py)", "bench_ray.py", argv,
                   runs=f"medians of {runs} run(s), each measuring every row.", body=body,
                   quick=a.quick or runs < 3, started=started, packages=("ray", "gymnasium"))


if __name__ == "__main__":
    print(main())
