"""Issue 36.4 and 36.5: the CLI on the folders users actually have.

- a stable-baselines3 buffer's ``cache_path`` (``sb3.json`` plus stores inside: ``transitions``,
  ``rollout``, ``history/env_<i>``, ``env_<i>/...``), built by the real trajstore.sb3 buffers;
- a sharded dataset's root (trajstore.shards), for ``ls`` and the one-store commands;
- ``trajstore convert``: a real demo store and a real one-env SB3 replay buffer become trajectory
  stores that ``filter``, ``split``, ``combine`` and ``TrajectoryReplayBuffer.load_from`` take.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_cli import cli, cli_json  # the CLI run in this process, its output captured

from trajstore import TrajectoryReplayBuffer
from trajstore.demo import record_demo
from trajstore.errors import NotATrajstoreError
from trajstore.sb3 import DummyVecRolloutBuffer, ZarrReplayBuffer, ZarrRolloutBuffer
from trajstore.shards import create_shard

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACT = gym.spaces.Box(-1, 1, (2,), np.float32)


def replay_root(path: Path, n_envs: int, steps: int = 20) -> Path:
    """A real ZarrReplayBuffer's cache_path; env e's episode ends every 5 + e steps."""
    rb = ZarrReplayBuffer(50, OBS, ACT, n_envs=n_envs, cache_path=path)
    for t in range(steps):
        done = np.array([(t + 1) % (5 + e) == 0 for e in range(n_envs)])
        rb.add(np.full((n_envs, 3), t, np.float32), np.full((n_envs, 3), t + 1, np.float32),
               np.zeros((n_envs, 2), np.float32), np.full(n_envs, t, np.float32), done, [{} for _ in range(n_envs)])
    rb.close()
    return path


def _rollout_steps(buf, n_envs: int, n_steps: int) -> None:
    for t in range(n_steps):
        buf.add(np.full((n_envs, 3), t, np.float32), np.zeros((n_envs, 2), np.float32), np.ones(n_envs, np.float32),
                np.array([t % 3 == 0] * n_envs), torch.zeros(n_envs), torch.zeros(n_envs))
    buf.compute_returns_and_advantage(torch.zeros(n_envs), np.zeros(n_envs))


# -- 36.4: a stable-baselines3 buffer's cache_path -----------------------------------------------------
def test_replay_buffer_folder_info_ls_verify_show_its_store(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=2)
    info = cli_json(capsys, "info", str(root))
    assert info["layout"] == "sb3" and info["kind"] == "ZarrReplayBuffer" and info["record"]["n_envs"] == 2
    assert list(info["parts"]) == ["transitions"] and info["problems"] == []
    assert info["parts"]["transitions"]["tables"]["step_data"]["rows"] == 20
    code, out, _ = cli(capsys, "info", str(root))
    assert code == 0 and "stable-baselines3 ZarrReplayBuffer" in out and f"== transitions ({root / 'transitions'})" in out
    arrays = cli_json(capsys, "ls", str(root))["parts"]["transitions"]
    assert {"step_data/obs.0", "step_data/obs.1", "step_data/done"} <= {a["path"] for a in arrays}
    code, out, err = cli(capsys, "verify", str(root))
    assert code == 0, out + err
    assert "root-missing" not in out and f"OK: {root / 'transitions'}" in out and f"OK: {root} (1 store(s))" in out
    stats = cli_json(capsys, "stats", str(root))["parts"]["transitions"]
    assert {s["path"]: s["max"] for s in stats}["step_data/reward"] == 19
    # Two envs share each row (one done flag per env): no episodes, said per store, exit 0.
    eps = cli_json(capsys, "episodes", str(root))["parts"]["transitions"]
    assert "no terminated/truncated" in eps["error"]


def test_verify_of_a_buffer_folder_finds_damage_inside_and_a_missing_store(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=1)
    chunk = next(p for p in (root / "transitions" / "step_data" / "obs.0" / "c").rglob("*") if p.is_file())
    chunk.unlink()
    code, out, _ = cli(capsys, "verify", str(root))
    assert code == 1 and "FAULT missing-chunk: step_data/obs.0/c/" in out and f"FAULTS: {root}" in out
    rep = json.loads(cli(capsys, "verify", str(root), "--json")[1])
    assert rep["parts"]["transitions"]["ok"] is False
    os.rename(root / "transitions", tmp_path / "elsewhere")
    code, out, _ = cli(capsys, "verify", str(root))
    assert code == 1 and "problem: store 'transitions' is missing: the ZarrReplayBuffer cannot be reopened" in out


def test_a_malformed_record_is_a_problem_of_the_folder(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=1)
    (root / "sb3.json").write_text("{not json")
    code, out, _ = cli(capsys, "verify", str(root))
    assert code == 1 and "problem: sb3.json is not JSON" in out and f"OK: {root / 'transitions'}" in out
    (root / "sb3.json").write_text('{"kind": "ZarrReplayBuffer"}')  # no trajstore_sb3 version
    rep = json.loads(cli(capsys, "verify", str(root), "--json")[1])
    assert rep["problems"] == ["sb3.json is not a trajstore stable-baselines3 record (no trajstore_sb3 and kind)"]
    (root / "sb3.json").write_text("[" * 100_000 + "]" * 100_000)  # past JSON's depth: a RecursionError before
    code, out, _ = cli(capsys, "verify", str(root))
    assert code == 1 and "problem: sb3.json is not JSON" in out and f"OK: {root / 'transitions'}" in out


def test_rollout_history_episodes_are_listed_per_env(tmp_path: Path, capsys) -> None:
    ro = ZarrRolloutBuffer(9, OBS, ACT, n_envs=2, cache_path=tmp_path / "ppo", keep_history=True)
    _rollout_steps(ro, 2, 9)
    ro.close()
    out = cli_json(capsys, "episodes", str(tmp_path / "ppo"))
    assert sorted(out["parts"]) == ["history/env_0", "history/env_1", "rollout"]
    for env in ("history/env_0", "history/env_1"):  # episodes split at episode_starts (t = 0, 3, 6)
        assert [e["length"] for e in out["parts"][env]["episodes"]] == [3, 3, 3]
    assert "error" in out["parts"]["rollout"]  # observations only
    code, text, _ = cli(capsys, "episodes", str(tmp_path / "ppo"))
    assert code == 0 and "== history/env_1" in text and "3 episode(s) (from episode ids" in text


def test_dummy_vec_folder_walks_into_each_env_buffer(tmp_path: Path, capsys) -> None:
    dv = DummyVecRolloutBuffer(6, OBS, ACT, n_envs=2, cache_path=tmp_path / "dv", buffer_kwargs={"keep_history": True})
    _rollout_steps(dv, 2, 6)
    dv.close()
    info = cli_json(capsys, "info", str(tmp_path / "dv"))
    assert info["kind"] == "DummyVecRolloutBuffer"
    assert sorted(info["parts"]) == ["env_0/history", "env_0/rollout", "env_1/history", "env_1/rollout"]
    assert cli(capsys, "verify", str(tmp_path / "dv"))[0] == 0


def test_the_walk_never_follows_links_out_of_the_folder(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=1)
    outside = record_demo(str(tmp_path / "outside"), episodes=1)
    os.symlink(outside, root / "linked")
    info = cli_json(capsys, "info", str(root))
    assert list(info["parts"]) == ["transitions"]


def test_one_store_commands_name_the_stores_of_a_folder(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=1)
    code, _out, err = cli(capsys, "head", str(root))
    assert code == 1 and "not a trajstore store" in err and str(root / "transitions") in err
    with pytest.raises(NotATrajstoreError):  # the library itself is unchanged: one store per path
        TrajectoryReplayBuffer.load_from(root)


# -- 36.4: sharded roots -------------------------------------------------------------------------------
def test_ls_and_head_of_a_sharded_root(tmp_path: Path, capsys) -> None:
    space = gym.spaces.Dict({"obs": OBS, "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32)})
    for name, n in (("a", 7), ("b", 4)):
        with create_shard(tmp_path / "ds", space, shard=name) as w:
            w.extend({"obs": np.zeros((n, 3), np.float32), "reward": np.ones(n, np.float32)})
    out = cli_json(capsys, "ls", str(tmp_path / "ds"))
    assert out["layout"] == "sharded" and sorted(out["parts"]) == ["shards/a", "shards/b"]
    rows = {name: {a["path"]: a["committed_rows"] for a in arrays} for name, arrays in out["parts"].items()}
    assert rows["shards/a"]["step_data/obs"] == 7 and rows["shards/b"]["step_data/reward"] == 4
    code, text, _ = cli(capsys, "ls", str(tmp_path / "ds"))
    assert code == 0 and "== shards/b" in text and "step_episode_ids" in text
    code, _text, err = cli(capsys, "head", str(tmp_path / "ds"))
    assert code == 1 and str(tmp_path / "ds" / "shards" / "a") in err


# -- 36.5: trajstore convert -------------------------------------------------------------------------------
def test_convert_demo_store_then_every_episode_tool_takes_it(tmp_path: Path, capsys) -> None:
    demo = record_demo(str(tmp_path / "demo"), episodes=5)
    code, _out, err = cli(capsys, "filter", demo, str(tmp_path / "f"), "--where", "length > 1")
    assert code == 1 and "trajstore convert" in err  # the refusal names the way out
    before = cli_json(capsys, "episodes", demo)
    out = cli_json(capsys, "convert", demo, str(tmp_path / "traj"))
    assert out["episodes"] == 5 and out["in_progress"] is False and out["verified"]
    after = cli_json(capsys, "episodes", str(tmp_path / "traj"))
    assert after["source"] == "episode ids"
    strip = [{k: e[k] for k in ("id", "start", "length", "return", "terminated", "truncated", "live")}
             for e in before["episodes"]]
    assert [{k: e[k] for k in strip[0]} for e in after["episodes"]] == strip
    with TrajectoryReplayBuffer.load_from(tmp_path / "traj", read_only=True) as tb:
        returns = [e["return"] for e in before["episodes"]]
        for eid, ret in enumerate(returns):
            assert float(tb.get_episode(eid)["episode_data"]["return"][0]) == ret
        assert tb.current_episode_id == 5  # every episode finished: a fresh id is current
    keep = [e["id"] for e in before["episodes"] if e["return"] > 18]
    out = cli_json(capsys, "filter", str(tmp_path / "traj"), str(tmp_path / "good"), "--where", "return > 18")
    assert out["episodes"] == len(keep)
    assert cli(capsys, "split", str(tmp_path / "traj"), str(tmp_path / "sp_"), "--ratios", "a=0.6,b=0.4")[0] == 0
    assert cli(capsys, "combine", str(tmp_path / "sp_a"), str(tmp_path / "sp_b"), str(tmp_path / "all"))[0] == 0
    assert len(cli_json(capsys, "episodes", str(tmp_path / "all"))["episodes"]) == 5


def test_convert_a_one_env_sb3_replay_buffer_folder(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=1, steps=12)  # episodes end at t = 4, 9; 10, 11 in progress
    out = cli_json(capsys, "convert", str(root), str(tmp_path / "traj"))
    assert out["episodes"] == 3 and out["in_progress"] is True and out["steps"] == 12
    with TrajectoryReplayBuffer.load_from(tmp_path / "traj", read_only=True) as tb:
        eps = tb.episodes()
        assert eps["length"].tolist() == [5, 5, 2]
        assert tb.current_episode_id == 2  # the episode in progress continues
        np.testing.assert_array_equal(tb.get_episode(1)["step_data"]["obs.0"][:, 0], np.arange(5, 10))
        assert float(tb.get_episode(0)["episode_data"]["return"][0]) == sum(range(5))


def test_convert_refuses_what_has_no_episodes(tmp_path: Path, capsys) -> None:
    root = replay_root(tmp_path / "sac", n_envs=2)
    code, _out, err = cli(capsys, "convert", str(root), str(tmp_path / "x"))
    assert code == 1 and "n_envs=2" in err and not (tmp_path / "x").exists()
    record_demo(str(tmp_path / "demo"), episodes=1)
    cli(capsys, "convert", str(tmp_path / "demo"), str(tmp_path / "t"))
    code, _out, err = cli(capsys, "convert", str(tmp_path / "t"), str(tmp_path / "t2"))
    assert code == 1 and "expected a ReplayBuffer store" in err and not (tmp_path / "t2").exists()
