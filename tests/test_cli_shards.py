"""``trajstore info/episodes/stats/verify/copy`` on sharded dataset roots (trajstore.shards).

Real sharded datasets on disk (tmp_path) and in memory://, the CLI run in-process through
``trajstore.cli.main`` (fast) and as ``python -m trajstore`` processes (exit status, one-line
errors, a copy SIGKILLed mid-way); every number is compared with ``open_sharded``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.cli import main
from trajstore.shards import create_shard, open_sharded

STEP = gym.spaces.Dict({
    "obs": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32),
})
RSTEP = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
                         "terminated": gym.spaces.MultiBinary(1), "truncated": gym.spaces.MultiBinary(1)})
#: episode lengths of each shard (name order)
LENGTHS = {"actor-0": [10, 25], "actor-1": [7, 30, 12], "actor-2": [40]}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trajstore", *args], capture_output=True, text=True, timeout=120)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_json(capsys, *args: str) -> object:
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def make_dataset(root: str, storage_options: dict | None = None) -> dict[str, np.ndarray]:
    """Three trajectory shards (LENGTHS), all episodes finished; returns the rows in global order."""
    obs, rew = [], []
    for k, (name, lengths) in enumerate(LENGTHS.items()):
        with create_shard(root, STEP, shard=name, storage_options=storage_options) as w:
            for e, n in enumerate(lengths):
                o = (np.arange(n * 3, dtype=np.float32).reshape(n, 3) + 100 * k + 10 * e) / 3
                r = np.full(n, k + 0.25 * e, np.float32)
                w.extend({"obs": o, "reward": r})
                w.mark_episode_end()
                obs.append(o)
                rew.append(r)
    return {"obs": np.concatenate(obs), "reward": np.concatenate(rew)}


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, dict[str, np.ndarray]]:
    root = str(tmp_path / "ds")
    return root, make_dataset(root)


def test_info_episodes_stats_match_open_sharded(dataset, capsys) -> None:
    root, data = dataset
    ds = open_sharded(root)
    shards, eps = ds.shards, ds.episodes()
    info = cli_json(capsys, "info", root)
    assert info["sharded"] and info["kind"] == "TrajectoryReplayBuffer"
    assert [s["name"] for s in info["shards"]] == list(shards["shard"]) == list(LENGTHS)
    assert [s["rows"] for s in info["shards"]] == shards["rows"].tolist() == [sum(v) for v in LENGTHS.values()]
    assert info["rows"] == len(ds) == len(data["obs"])
    assert info["episodes"] == {"finished": 6, "in_progress": 0}
    assert set(info["spaces"]) == {"step_data"} and info["stored_bytes"] > 0
    code, text, _ = cli(capsys, "info", root)
    assert code == 0 and "shards         3" in text and "actor-1" in text and f"{len(ds)} steps" in text

    got = cli_json(capsys, "episodes", root)
    assert got["episodes_total"] == 6 and got["reward_field"] == "step_data/reward"
    rows = got["episodes"]
    assert [r["id"] for r in rows] == eps["episode_id"].tolist()
    assert [r["shard"] for r in rows] == list(eps["shard"])
    assert [r["shard_episode_id"] for r in rows] == eps["shard_episode_id"].tolist()
    assert [r["start"] for r in rows] == eps["start"].tolist()
    assert [r["length"] for r in rows] == eps["length"].tolist()
    for r in rows:
        assert r["return"] == pytest.approx(float(data["reward"][r["start"]: r["start"] + r["length"]].sum()))
    code, text, _ = cli(capsys, "episodes", root, "--sort", "length", "--limit", "2")
    lines = text.splitlines()
    assert code == 0 and lines[1].split()[:2] == ["shard", "id"]
    assert lines[2].split()[:4] == ["actor-2", "0", "84", "40"] and "4 more" in lines[-1]

    stats = {s["path"]: s for s in cli_json(capsys, "stats", root)}
    for name in ("obs", "reward"):
        s, a = stats[f"step_data/{name}"], data[name].astype(np.float64)
        assert s["rows"] == len(a) and s["count"] == a.size
        assert s["min"] == a.min() and s["max"] == a.max()
        assert s["mean"] == pytest.approx(a.mean()) and s["std"] == pytest.approx(a.std())
    code, text, _ = cli(capsys, "stats", root, "--field", "obs")
    assert code == 0 and "step_data/obs" in text and "reward" not in text
    ds.close()


def test_memory_url_with_storage_options(capsys) -> None:
    root = f"memory://cli-shards-{uuid.uuid4().hex}"
    data = make_dataset(root, storage_options={})
    opts = ("--storage-options", "{}")
    info = cli_json(capsys, "info", root, *opts)
    assert info["rows"] == len(data["obs"]) and len(info["shards"]) == 3
    assert len(cli_json(capsys, "episodes", root, *opts)["episodes"]) == 6
    assert cli_json(capsys, "verify", root, *opts)["ok"] is True


def test_verify_names_the_shard_of_each_fault(dataset, capsys, tmp_path: Path) -> None:
    root, _ = dataset
    code, text, _ = cli(capsys, "verify", root)
    assert code == 0 and text.splitlines()[-1].startswith("OK:") and text.count("OK: shard") == 3
    rep = cli_json(capsys, "verify", root)
    assert rep["ok"] and set(rep["shards"]) == set(LENGTHS) and rep["root"]["faults"] == []

    os.remove(os.path.join(root, "shards", "actor-1", "step_data", "obs", "c", "0", "0"))
    # a store with other spaces dropped into the shards folder
    ReplayBuffer.create(RSTEP, cache_path=os.path.join(root, "shards", "intruder")).close()
    code, text, _ = cli(capsys, "verify", root)
    faults = [line for line in text.splitlines() if line.startswith("FAULT")]
    assert code == 1 and faults
    assert all(line.startswith(("FAULT shard actor-1 ", "FAULT shard intruder spaces")) for line in faults)
    assert any("actor-1" in line and "step_data/obs" in line for line in faults)
    assert any(line.startswith("FAULT shard intruder spaces") for line in faults)
    rep = json.loads(cli(capsys, "verify", root, "--json")[1])
    assert not rep["ok"] and rep["shards"]["actor-0"]["ok"] and not rep["shards"]["actor-1"]["ok"]

    Path(root, "trajstore.shards.json").write_text('{"format": "trajstore-sharded", "format_version": 1, "kind": "X"}')
    code, text, _ = cli(capsys, "verify", root)
    assert code == 1 and text.startswith("FAULT root record:") and "kind is 'X'" in text.splitlines()[0]
    assert "OK: shard actor-0" in text  # the shards are still checked


def test_tampered_root_is_a_one_line_error(dataset, capsys, tmp_path: Path) -> None:
    root, _ = dataset
    record = Path(root, "trajstore.shards.json")
    good = record.read_text()
    outside = tmp_path / "outside.json"
    outside.write_text(good)
    cases = {
        "garbage": lambda: record.write_text("{not json"),
        "newer": lambda: record.write_text(good.replace('"format_version": 1', '"format_version": 99')),
        "huge": lambda: record.write_text(" " * (2 << 20) + good),
        "link": lambda: (record.unlink(), record.symlink_to(outside)),
    }
    for what, damage in cases.items():
        damage()
        for args in (("info", root), ("episodes", root), ("stats", root),
                     ("copy", root, str(tmp_path / f"merged-{what}"))):
            code, _, err = cli(capsys, *args)
            assert code == 1 and err.count("\n") == 1 and "trajstore.shards.json" in err, (what, args, err)
        assert not (tmp_path / f"merged-{what}").exists()
        code, text, _ = cli(capsys, "verify", root)
        assert code == 1 and text.startswith("FAULT root record:"), (what, text)
        if what == "garbage":  # the same from a real process: exit status and one stderr line, no traceback
            out = run_cli("info", root)
            assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
            assert run_cli("verify", root).returncode == 1
        record.unlink()
        record.write_text(good)
    assert outside.read_text() == good
    os.rename(os.path.join(root, "shards", "actor-2"), os.path.join(root, "shards", "..bad"))
    out = run_cli("info", root)
    assert out.returncode == 1 and "'..bad'" in out.stderr and out.stderr.strip().count("\n") == 0


def test_copy_merges_into_one_verified_store(dataset, capsys, tmp_path: Path) -> None:
    root, data = dataset
    dst = str(tmp_path / "merged")
    out = run_cli("copy", root, dst, "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["method"] == "merge" and rep["shards"] == 3 and rep["rows"] == len(data["obs"]) and rep["verified"]
    with TrajectoryReplayBuffer.load_from(dst, read_only=True) as merged:
        np.testing.assert_array_equal(merged.get_column(["step_data", "obs"])[...], data["obs"])
        assert merged.episodes()["length"].tolist() == [n for v in LENGTHS.values() for n in v]
    code, _, err = cli(capsys, "copy", root, dst)
    assert code == 1 and "--overwrite" in err
    code, text, _ = cli(capsys, "copy", root, dst, "--overwrite", "--chunk-rows", "16")
    assert code == 0 and "3 shard(s), merged" in text and "relayout" in text
    code, text, _ = cli(capsys, "copy", root, str(tmp_path / "merged.zip"))
    assert code == 0 and "zip" in text
    assert cli_json(capsys, "info", str(tmp_path / "merged.zip"))["tables"]["step_data"]["rows"] == len(data["obs"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary folder left behind
    # a dataset of ReplayBuffer shards: episodes from its flags, merged into a ReplayBuffer
    rroot = str(tmp_path / "rds")
    for k in range(2):
        with create_shard(rroot, RSTEP, shard=f"s{k}", kind="replay") as w:
            done = np.zeros((20, 1), np.int8)
            done[[4, 19]] = 1
            w.extend({"obs": np.full((20, 2), k, np.float32), "terminated": done, "truncated": np.zeros((20, 1), np.int8)})
    eps = cli_json(capsys, "episodes", rroot)["episodes"]
    assert [(e["shard"], e["start"], e["length"]) for e in eps] == [("s0", 0, 5), ("s0", 5, 15), ("s1", 20, 5),
                                                                    ("s1", 25, 15)]
    assert cli_json(capsys, "copy", rroot, str(tmp_path / "rmerged"))["rows"] == 40
    with ReplayBuffer.load_from(str(tmp_path / "rmerged"), read_only=True) as rb:
        assert len(rb) == 40 and rb[25]["obs"].tolist() == [1.0, 1.0]


def test_copy_after_a_copy_killed_at_its_publish(tmp_path: Path, procs: list) -> None:
    """A sharded copy SIGKILLed after its journal, before its rename (the merged store verified and
    waiting): the next ``copy --overwrite`` first completes that publish, then replaces it (CI once
    saw it refuse instead: the destination had "appeared while the new store was written", because
    the completion came after the existence check)."""
    import _publish_workers as P
    import _workers as W

    root = str(tmp_path / "shards")
    for name in ("a", "b"):
        with create_shard(root, STEP, shard=name, kind="replay") as w:
            w.extend({"obs": np.ones((50, 3), np.float32), "reward": np.arange(50, dtype=np.float32)})
    dst, ready = tmp_path / "merged", str(tmp_path / "ready")
    p = W.start(P.run, "cli-copy", [root, str(dst)], "journal", ready)
    procs.append(p)
    W.wait_for_file(ready, p)
    W.kill(p)
    procs.remove(p)
    assert not dst.exists() and any(".trajstore-publish-" in n for n in os.listdir(tmp_path))
    out = run_cli("copy", root, str(dst), "--overwrite", "--json")
    assert out.returncode == 0, out.stderr
    assert "completed the publish" in out.stderr and json.loads(out.stdout)["rows"] == 100
    assert run_cli("verify", str(dst)).returncode == 0
    assert [n for n in os.listdir(tmp_path) if n.startswith(".merged.")] == []


def test_copy_sigkilled_midway_leaves_no_partial_store(tmp_path: Path) -> None:
    """A ``trajstore copy`` of a sharded dataset SIGKILLed mid-way: the destination is absent or a
    whole verified store (never a partial one), the dataset is intact, and a new copy succeeds and
    removes what the killed one left."""
    root = str(tmp_path / "big")
    n = 150_000
    for name in ("a", "b"):
        with create_shard(root, STEP, shard=name, kind="replay") as w:
            w.extend({"obs": np.ones((n, 3), np.float32), "reward": np.arange(n, dtype=np.float32)})
    dst = tmp_path / "merged"
    proc = subprocess.Popen([sys.executable, "-m", "trajstore", "copy", root, str(dst)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not any(p.startswith(".merged.trajstore-partial-") for p in os.listdir(tmp_path)):  # the build folder
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the copy never started its build folder"
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    print("killed", "after" if dst.exists() else "before", "the rename")
    if dst.exists():  # killed after the rename: then it is the whole store
        assert run_cli("verify", str(dst)).returncode == 0
        with ReplayBuffer.load_from(str(dst), read_only=True) as rb:
            assert len(rb) == 2 * n
    else:
        assert run_cli("info", str(dst)).returncode == 1
    assert run_cli("verify", root).returncode == 0
    out = run_cli("copy", root, str(dst), "--overwrite", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"] == 2 * n
    # the killed copy's build folder was removed by the new one (its process is gone)
    assert [p for p in os.listdir(tmp_path) if p.startswith(".merged.")] == []
