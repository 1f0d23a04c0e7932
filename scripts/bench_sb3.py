"""stable-baselines3 benchmark: trajstore's SB3 buffers against SB3's default in-RAM buffers, as
ratios measured in one run (runs alternate, so machine load drifts hit both sides alike).

- SAC on Pendulum-v1 (600 steps, 300 of them with a gradient step) with ZarrReplayBuffer vs SB3's
  ReplayBuffer (target <= 1.05);
- PPO on CartPole-v1 with 8 envs (8,192 steps) with DummyVecRolloutBuffer and with
  ZarrRolloutBuffer vs SB3's RolloutBuffer (target <= 1.10);

``ZarrReplayBuffer.add`` and ``sample(256)`` of (84,84,4) uint8 frames against SB3's ReplayBuffer are
measured in scripts/bench_images.py (cold and steady, blocks of consecutive calls, at 1e3-1e5
transitions).

    python scripts/bench_sb3.py            # full sizes, 5 runs per side (about 3.5 minutes on 2 cores)
    python scripts/bench_sb3.py --quick    # small sizes (smoke test)

``main`` returns the section of docs/benchmarks.md (scripts/bench_all.py writes it there).

Training runs use CPU, one torch thread, a fixed seed; both sides train the same policy (the
buffers return bit-identical batches), so the wall-clock difference is the buffers' cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch as th  # noqa: E402
from benchdoc import section  # noqa: E402
from stable_baselines3 import PPO, SAC  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402

from trajstore.sb3 import DummyVecRolloutBuffer, ZarrReplayBuffer, ZarrRolloutBuffer  # noqa: E402

Row = dict[str, Any]


def _alternate(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of each run's seconds: ``repeats`` rounds calling every run once, in an order
    rotated each round (so warm-up and load drift do not favour one side)."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(runs[name]())
    return {name: statistics.median(ts) for name, ts in times.items()}


def _learn_seconds(model: Any, steps: int) -> float:
    t = time.perf_counter()
    model.learn(steps)
    seconds = time.perf_counter() - t
    buf = getattr(model, "replay_buffer", None) or model.rollout_buffer
    if hasattr(buf, "close"):
        buf.close()
    return seconds


def bench_sac(tmp: Path, steps: int, repeats: int) -> list[Row]:
    def run(**kw: Any) -> Callable[[], float]:
        def go() -> float:
            env = make_vec_env("Pendulum-v1", n_envs=1, seed=0)
            return _learn_seconds(SAC("MlpPolicy", env, seed=0, device="cpu", learning_starts=steps // 2, **kw),
                                  steps)
        return go

    t = _alternate({"sb3": run(), "ours": run(replay_buffer_class=ZarrReplayBuffer,
                                              replay_buffer_kwargs=dict(cache_path=tmp / "sac", overwrite=True))},
                   repeats)
    return [{"what": f"SAC Pendulum-v1, {steps:,} steps, learning_starts {steps // 2:,} (ZarrReplayBuffer)", "unit": "s", "ours": t["ours"],
             "sb3": t["sb3"], "target": 1.05}]


def bench_ppo(tmp: Path, steps: int, n_steps: int, repeats: int) -> list[Row]:
    def run(**kw: Any) -> Callable[[], float]:
        def go() -> float:
            env = make_vec_env("CartPole-v1", n_envs=8, seed=0)
            return _learn_seconds(PPO("MlpPolicy", env, n_steps=n_steps, seed=0, device="cpu", **kw), steps)
        return go

    t = _alternate({
        "sb3": run(),
        "dummyvec": run(rollout_buffer_class=DummyVecRolloutBuffer,
                        rollout_buffer_kwargs=dict(cache_path=tmp / "ppo_dv", buffer_kwargs=dict(overwrite=True))),
        "zarr": run(rollout_buffer_class=ZarrRolloutBuffer,
                    rollout_buffer_kwargs=dict(cache_path=tmp / "ppo_z", overwrite=True)),
    }, repeats)
    label = f"PPO CartPole-v1, 8 envs, n_steps {n_steps}, {steps:,} steps"
    return [{"what": f"{label} (DummyVecRolloutBuffer)", "unit": "s", "ours": t["dummyvec"], "sb3": t["sb3"],
             "target": 1.10},
            {"what": f"{label} (ZarrRolloutBuffer)", "unit": "s", "ours": t["zarr"], "sb3": t["sb3"], "target": 1.10}]


def table(rows: list[Row]) -> str:
    lines = ["| measurement | unit | trajstore | SB3 default | ratio | target |", "|---|---|---|---|---|---|"]
    for r in rows:
        target = f"<= {r['target']:.2f}" if "target" in r else "-"
        lines.append(f"| {r['what']} | {r['unit']} | {r['ours']:.3g} | {r['sb3']:.3g} | {r['ours'] / r['sb3']:.2f}x "
                     f"| {target} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    p.add_argument("--repeats", type=int, default=None, help="runs per side (the median's; default 5, --quick 1)")
    p.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = p.parse_args(argv)
    th.set_num_threads(1)
    args.repeats = args.repeats or (1 if args.quick else 5)
    if args.quick:
        sac_steps, ppo_steps, n_steps = 120, 8 * 32 * 3, 32
    else:
        sac_steps, ppo_steps, n_steps = 600, 8_192, 256
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        tmp = Path(d)
        rows = bench_ppo(tmp, ppo_steps, n_steps, args.repeats)
        rows += bench_sac(tmp, sac_steps, args.repeats)
    body = ("Training: wall-clock of `learn`, CPU, one torch thread, the same seed on both sides (the "
            "buffers return bit-identical batches, so both train the same policy and the difference is the "
            "buffers' cost); the runs alternate, the order rotated each round. Ratio = trajstore / SB3 default "
            "(lower is better). `ZarrReplayBuffer`'s `add` and `sample` of image frames: the image section.\n\n"
            + table(rows))
    return section("stable-baselines3 training (scripts/bench_sb3.py)", "bench_sb3.py", argv,
                   runs=f"each time is the median of {args.repeats} `learn` runs per side.", body=body,
                   quick=args.quick, started=started, packages=("torch", "stable-baselines3"))


if __name__ == "__main__":
    print(main())
