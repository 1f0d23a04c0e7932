"""The ``trajstore`` command line on real stores (local folders, memory://, .zip).

Every command is run in-process through ``trajstore.cli.main`` (fast) and a few through
``python -m trajstore`` (exit status and the one-line stderr of real processes).  Damaged
stores are made by hand, one way at a time, and must be reported by ``verify`` with the exact
exit status and message; ``repair`` must then make ``verify`` pass where recovery is possible
and change nothing where it is not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.cli import main
from trajstore.storage.keys import FORMAT_VERSION

OBS = gym.spaces.Box(-np.inf, np.inf, (17,), np.float32)
STEP = gym.spaces.Dict({
    "obs": OBS,
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32),
    "terminated": gym.spaces.MultiBinary(1),
    "truncated": gym.spaces.MultiBinary(1),
})
LENGTHS = [700, 300, 900, 500, 600]  # 3000 rows: obs chunks 0, 1, 2 (1024 rows each)


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


def memory_url() -> str:
    return f"memory://cli-{uuid.uuid4().hex}"


def _episode_rows() -> dict[str, np.ndarray]:
    n = sum(LENGTHS)
    ep = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    obs = np.arange(n * 17, dtype=np.float32).reshape(n, 17) / 7
    reward = (ep + 1).astype(np.float32) * 0.5
    last = np.cumsum(LENGTHS) - 1
    term = np.zeros((n, 1), np.int8)
    trunc = np.zeros((n, 1), np.int8)
    term[last[:-2]] = 1
    trunc[last[-2]] = 1  # the last episode is still running (no flag)
    return {"obs": obs, "reward": reward, "terminated": term, "truncated": trunc}


def make_rb(path: str | Path, compressor: str | None = None) -> dict[str, np.ndarray]:
    """A ReplayBuffer of five CartPole-like episodes; returns what was written."""
    data = _episode_rows()
    with ReplayBuffer.create(STEP, cache_path=str(path), compressor=compressor, chunk_rows=1024, overwrite=True) as rb:
        rb.extend(data)
    return data


def make_traj(path: str | Path, compressor: str | None = None) -> None:
    """A TrajectoryReplayBuffer (a ring of 4096 steps) with episode data; the last episode is open."""
    sp = gym.spaces.Dict({"obs": OBS, "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32)})
    with TrajectoryReplayBuffer.create(sp, step_data_capacity=4096, cache_path=str(path), overwrite=True,
                                       episode_data_instance_space=gym.spaces.Box(-np.inf, np.inf, (), np.float32),
                                       compressor=compressor, chunk_rows=1024) as tb:
        for e, n in enumerate(LENGTHS):
            obs = np.full((n, 17), e, np.float32)
            obs[0, 0] = np.nan if e == 1 else obs[0, 0]
            tb.extend({"obs": obs, "reward": np.full(n, e + 1, np.float32)})
            tb.set_current_episode_data(np.float32(10 * e))
            if e < len(LENGTHS) - 1:
                tb.mark_episode_end()


# -- inspection commands --------------------------------------------------------------------------------
def test_demo_records_reopens_and_prints_info(tmp_path: Path) -> None:
    out = run_cli("demo", str(tmp_path / "demo"), "--episodes", "3")
    assert out.returncode == 0, out.stderr
    assert "recorded 3 episodes of CartPole-v1" in out.stdout
    assert "kind           ReplayBuffer" in out.stdout
    rb = ReplayBuffer.load_from(tmp_path / "demo", read_only=True)
    # Random CartPole episodes end with exactly three terminal or truncated rows.
    flags = rb.get_column(["terminated"]).to_numpy() | rb.get_column(["truncated"]).to_numpy()
    assert flags.dtype == np.bool_ and int(flags.sum()) == 3 and flags[-1]
    # Within an episode, each row's next_obs is the following row's obs.
    cont = ~flags[:-1].astype(bool)
    np.testing.assert_array_equal(rb[:-1]["next_obs"][cont], rb[1:]["obs"][cont])
    rb.close()


def test_info_json_matches_the_python_api(tmp_path: Path, capsys) -> None:
    space = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (17,), np.float32), "a": gym.spaces.Discrete(3)})
    with ReplayBuffer.create(space, cache_path=tmp_path / "s", capacity=100, compressor="lz4") as rb:
        for i in range(130):
            rb.append({"obs": np.full(17, i, np.float32), "a": i % 3})
        count, offset = rb.count, rb.offset
    info = cli_json(capsys, "info", str(tmp_path / "s"))
    assert info["kind"] == "ReplayBuffer" and info["format_version"] == FORMAT_VERSION
    assert info["tables"]["step_data"] == {"rows": count, "capacity": 100, "offset": offset}
    assert {a["path"] for a in info["arrays"]} == {"step_data/obs", "step_data/a"}
    assert all(a["codec"] == "blosc:lz4" for a in info["arrays"])
    assert info["stored_bytes"] > 0 and info["logical_bytes"] == 100 * (17 * 4 + 8)
    assert info["compression_ratio"] == pytest.approx(info["logical_bytes"] / sum(a["stored_bytes"] for a in info["arrays"]))
    assert info["episodes"] is None  # no episode ids and no terminated/truncated flags

    code, text, _ = cli(capsys, "info", str(tmp_path / "s"))
    assert code == 0 and "rows=100 capacity=100" in text and "obs: Box" in text and "ratio" in text


def test_info_and_episodes_of_a_trajectory_store_match_the_python_api(tmp_path: Path, capsys) -> None:
    make_traj(tmp_path / "t")
    tb = TrajectoryReplayBuffer.load_from(tmp_path / "t", read_only=True)
    api = tb.episodes()
    rew = tb[:]["step_data"]["reward"]
    ids = tb.get_at_with_metadata(slice(None))[1]["episode_ids"]
    info = cli_json(capsys, "info", str(tmp_path / "t"))
    assert info["kind"] == "TrajectoryReplayBuffer"
    assert info["tables"]["step_data"] == {"rows": len(tb), "capacity": 4096, "offset": tb.offset}
    # (finished / in_progress / finished_total were added; the earlier keys keep their meaning)
    want = {"present": len(api["episode_id"]), "total": tb.current_episode_id + 1,
            "current_id": tb.current_episode_id, "with_data": 5, "source": "episode ids"}
    assert {k: info["episodes"][k] for k in want} == want
    assert info["episodes"]["finished"] + info["episodes"]["in_progress"] == len(api["episode_id"])

    eps = cli_json(capsys, "episodes", str(tmp_path / "t"))
    assert [e["id"] for e in eps["episodes"]] == api["episode_id"].tolist()
    assert [e["start"] for e in eps["episodes"]] == api["start"].tolist()
    assert [e["length"] for e in eps["episodes"]] == api["length"].tolist()
    assert [e["live"] for e in eps["episodes"]] == api["live"].tolist()
    expect = [float(rew[ids == i].astype(np.float64).sum()) for i in api["episode_id"]]
    assert [e["return"] for e in eps["episodes"]] == pytest.approx(expect)
    assert eps["reward_field"] == "step_data/reward"
    # The 4096-step ring dropped the start of episode 0: 3000 - 4096 < 0, so here nothing was evicted.
    assert sum(e["length"] for e in eps["episodes"]) == len(tb)

    top = cli_json(capsys, "episodes", str(tmp_path / "t"), "--sort", "return", "--limit", "2")
    assert [e["return"] for e in top["episodes"]] == sorted(expect, reverse=True)[:2]
    code, text, _ = cli(capsys, "episodes", str(tmp_path / "t"), "--sort", "length", "--limit", "1")
    assert code == 0 and text.splitlines()[2].split()[:3] == ["2", "1000", "900"] and "4 more" in text
    tb.close()


def test_episodes_of_a_replay_buffer_come_from_its_flags(tmp_path: Path, capsys) -> None:
    data = make_rb(tmp_path / "r")
    eps = cli_json(capsys, "episodes", str(tmp_path / "r"))
    assert eps["source"] == "terminated/truncated flags"
    assert [e["length"] for e in eps["episodes"]] == LENGTHS
    starts = np.concatenate([[0], np.cumsum(LENGTHS)[:-1]])
    assert [e["start"] for e in eps["episodes"]] == starts.tolist()
    assert [e["return"] for e in eps["episodes"]] == pytest.approx(
        [float(data["reward"][s:s + n].sum()) for s, n in zip(starts, LENGTHS)])
    assert [e["terminated"] for e in eps["episodes"]] == [True, True, True, False, False]
    assert [e["truncated"] for e in eps["episodes"]] == [False, False, False, True, False]
    assert [e["live"] for e in eps["episodes"]] == [False, False, False, False, True]
    # --reward-field names the field explicitly; a field that is not a scalar is refused.
    assert cli_json(capsys, "episodes", str(tmp_path / "r"), "--reward-field", "reward")["reward_field"] == "step_data/reward"
    code, _out, err = cli(capsys, "episodes", str(tmp_path / "r"), "--reward-field", "obs")
    assert code == 1 and "must name one scalar step field" in err


def test_ls_lists_every_array(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r", compressor="zstd")
    arrays = cli_json(capsys, "ls", str(tmp_path / "r"))
    by = {a["path"]: a for a in arrays}
    assert set(by) == {"step_data/obs", "step_data/reward", "step_data/terminated", "step_data/truncated"}
    assert by["step_data/obs"]["committed_rows"] == 3000 and by["step_data/obs"]["codec"] == "blosc:zstd"
    assert by["step_data/obs"]["chunks"] == [1024, 17] and by["step_data/obs"]["stored_chunks"] == 3
    assert by["step_data/obs"]["ratio"] == pytest.approx(3000 * 68 / by["step_data/obs"]["stored_bytes"])
    code, text, _ = cli(capsys, "ls", str(tmp_path / "r"))
    assert code == 0 and text.splitlines()[0].split() == ["path", "shape", "rows", "dtype", "chunks", "codec", "stored", "ratio"]


def test_head_prints_rows_and_summarizes_large_arrays(tmp_path: Path, capsys) -> None:
    data = make_rb(tmp_path / "r")
    out = cli_json(capsys, "head", str(tmp_path / "r"), "-n", "3")
    assert out["rows"] == [0, 1, 2]
    first = out["values"][0]
    assert first["step_data/obs"] == {"shape": [17], "dtype": "float32", "min": pytest.approx(0.0),
                                      "max": pytest.approx(float(data["obs"][0].max()))}
    assert first["step_data/reward"] == 0.5 and first["step_data/terminated"] == [0]
    # --field narrows to one array, --episode to the rows of one episode.
    out = cli_json(capsys, "head", str(tmp_path / "r"), "-n", "2", "--field", "reward", "--episode", "2")
    assert out["fields"] == ["step_data/reward"] and out["rows"] == [1000, 1001]
    assert [v["step_data/reward"] for v in out["values"]] == [1.5, 1.5]
    code, text, _ = cli(capsys, "head", str(tmp_path / "r"), "-n", "1")
    assert code == 0 and "step_data/obs: shape=(17,) float32 min=0.0" in text
    code, _t, err = cli(capsys, "head", str(tmp_path / "r"), "--field", "nope")
    assert code == 1 and "no array matches field 'nope'" in err and err.count("\n") == 1
    code, _t, err = cli(capsys, "head", str(tmp_path / "r"), "--episode", "99")
    assert code == 1 and "episode 99 has no steps" in err


def test_head_of_episode_data_and_episode_of_a_trajectory(tmp_path: Path, capsys) -> None:
    make_traj(tmp_path / "t")
    out = cli_json(capsys, "head", str(tmp_path / "t"), "--field", "episode_data", "-n", "10")
    assert out["table"] == "episode_data"
    assert [v["episode_data/value"] for v in out["values"]] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert [v["episode_data/_episode_id"] for v in out["values"]] == [0, 1, 2, 3, 4]
    out = cli_json(capsys, "head", str(tmp_path / "t"), "--episode", "3", "-n", "1", "--field", "step_episode_ids")
    assert out["rows"] == [1900] and out["values"][0]["step_episode_ids"] == 3


def test_stats_match_numpy_on_local_and_memory_stores(tmp_path: Path, capsys) -> None:
    for path in (str(tmp_path / "t"), memory_url()):
        make_traj(path, compressor="lz4")
        tb = TrajectoryReplayBuffer.load_from(path, read_only=True)
        obs = tb[:]["step_data"]["obs"]
        stats = {s["path"]: s for s in cli_json(capsys, "stats", path)}
        s = stats["step_data/obs"]
        finite = obs[np.isfinite(obs)].astype(np.float64)
        assert s["rows"] == len(tb) and s["nan"] == 1 and s["inf"] == 0 and s["count"] == finite.size
        assert s["min"] == finite.min() and s["max"] == finite.max()
        assert s["mean"] == pytest.approx(finite.mean()) and s["std"] == pytest.approx(finite.std())
        assert stats["episode_data/value"]["max"] == 40.0 and stats["episode_data/value"]["rows"] == 5
        only = cli_json(capsys, "stats", path, "--field", "reward")
        assert [x["path"] for x in only] == ["step_data/reward"]
        code, text, _ = cli(capsys, "stats", path)
        assert code == 0 and "step_data/obs" in text and "nan" in text.splitlines()[0]
        tb.close()


def test_stats_read_in_bounded_blocks(tmp_path: Path, capsys, monkeypatch) -> None:
    import trajstore.maintenance.summary as summary
    from trajstore.maintenance.moments import field_stats

    make_rb(tmp_path / "r")
    monkeypatch.setattr(summary, "BLOCK_BYTES", 4096)  # force many blocks
    seen: list[int] = []
    store = summary.open_store(tmp_path / "r")
    try:
        stats = field_stats(store, "obs", progress=seen.append)
    finally:
        store.close()
    assert len(seen) > 10 and max(seen) <= 4096 // 68 + 1 and sum(seen) == 3000
    obs = _episode_rows()["obs"].astype(np.float64)
    assert stats[0]["mean"] == pytest.approx(obs.mean()) and stats[0]["std"] == pytest.approx(obs.std())


# -- verify / repair --------------------------------------------------------------------------------------
def _verify(capsys, path: str, *extra: str) -> tuple[int, str]:
    code, out, err = cli(capsys, "verify", path, *extra)
    assert err == ""
    return code, out


def test_verify_passes_on_healthy_stores_and_reports_in_json(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r")
    make_traj(tmp_path / "t", compressor="lz4")
    mem = memory_url()
    make_traj(mem)
    for path in (str(tmp_path / "r"), str(tmp_path / "t"), mem):
        code, out = _verify(capsys, path, "--deep")
        assert code == 0 and out.startswith("OK: ") and "chunks decoded" in out
    rep = cli_json(capsys, "verify", str(tmp_path / "r"))
    assert rep["ok"] is True and rep["faults"] == [] and rep["checked"]["rows"] == 3000
    assert rep["checked"]["arrays"] == 4 and rep["checked"]["chunks"] == 3 + 3 + 1 + 1


def test_missing_chunk_is_found_and_repaired_by_rolling_back(tmp_path: Path, capsys) -> None:
    data = make_rb(tmp_path / "r")
    os.remove(tmp_path / "r" / "step_data" / "obs" / "c" / "1" / "0")
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 1
    assert "FAULT missing-chunk: step_data/obs/c/1/0: chunk missing; table 'step_data' rows [1024, 2048) are lost" in out
    code, out, _ = cli(capsys, "verify", str(tmp_path / "r"), "--json")
    faults = json.loads(out)["faults"]
    assert code == 1 and [(f["kind"], f["key"], f["rows"]) for f in faults] == [("missing-chunk", "step_data/obs/c/1/0", [1024, 2048])]

    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"), "--dry-run")
    assert code == 0 and "would roll back trajstore.head.json" in out and "nothing written" in out
    assert _verify(capsys, str(tmp_path / "r"))[0] == 1  # the dry run changed nothing
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 0, out
    assert "rolled back trajstore.head.json: table 'step_data': dropped damaged or missing rows [1024, 3000)" in out
    assert out.rstrip().splitlines()[-1].startswith("OK: ")
    # Intact chunks of the dropped rows are kept for salvage (zarr reads them); a second repair removes them.
    kept = next(line for line in out.splitlines() if line.startswith("kept "))
    assert "step_data/obs/c/2/0" in kept and "step_data/reward/c/2" in kept
    assert "3 intact chunk(s) of the dropped rows stay on disk" in kept
    chunk2 = tmp_path / "r" / "step_data" / "obs" / "c" / "2" / "0"
    assert chunk2.exists()
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 0 and "3 chunk(s) hold no committed row" in out
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 0 and "deleted step_data/obs/c/2/0: uncommitted chunk" in out and not chunk2.exists()
    with ReplayBuffer.load_from(tmp_path / "r") as rb:  # a writer opens it and can append again
        assert len(rb) == 1024
        np.testing.assert_array_equal(rb[:]["obs"], data["obs"][:1024])
        rb.extend({k: v[:10] for k, v in data.items()})
    assert _verify(capsys, str(tmp_path / "r"))[0] == 0


def test_truncated_chunk_file_is_found_and_repaired(tmp_path: Path, capsys) -> None:
    data = make_rb(tmp_path / "r")
    chunk = tmp_path / "r" / "step_data" / "obs" / "c" / "2" / "0"
    with open(chunk, "r+b") as f:
        f.truncate(100)
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 1
    assert ("FAULT truncated-chunk: step_data/obs/c/2/0: truncated chunk file (100 of 69632 bytes); table 'step_data' "
            "rows [2048, 3000) are damaged") in out
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 0 and "dropped damaged or missing rows [2048, 3000)" in out
    assert "deleted step_data/obs/c/2/0: damaged chunk (truncated-chunk) of dropped rows" in out
    assert not chunk.exists()  # a writer could not map it
    assert _verify(capsys, str(tmp_path / "r"), "--deep")[0] == 0
    with ReplayBuffer.load_from(tmp_path / "r", read_only=True) as rb:
        np.testing.assert_array_equal(rb[:]["obs"], data["obs"][:2048])


def test_commit_record_pointing_past_the_data(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r")
    (tmp_path / "r" / "trajstore.head.prev.json").unlink()  # a store from before the copy was kept
    head_path = tmp_path / "r" / "trajstore.head.json"
    head = json.loads(head_path.read_text())
    head["tables"]["step_data"].update(end=9000, allocated=9000)
    head_path.write_text(json.dumps(head))
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 1
    assert ("FAULT head-past-data: trajstore.head.json: table 'step_data' commits rows up to 9000 but step_data/obs "
            "has data only for rows [0, 3072) (no chunk from step_data/obs/c/3/0 on)") in out
    # Where the committed rows really ended cannot be known: repair refuses and changes nothing.
    before = head_path.read_bytes()
    code, out, err = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 1 and "recovery impossible: trajstore.head.json names rows past the stored data" in out
    assert head_path.read_bytes() == before


def test_garbage_commit_record(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r")
    (tmp_path / "r" / "trajstore.head.prev.json").unlink()  # a store from before the copy was kept
    head_path = tmp_path / "r" / "trajstore.head.json"
    good = head_path.read_bytes()
    head_path.write_bytes(b"\x00garbage{")
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 1 and out.startswith("FAULT head-unreadable: trajstore.head.json: the commit record is unreadable (")
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 1 and "recovery impossible: trajstore.head.json is missing or unreadable and no earlier consistent" in out
    assert head_path.read_bytes() == b"\x00garbage{"  # nothing changed
    # A complete record left in the temp folder by an interrupted commit is a consistent earlier state.
    (tmp_path / "r" / ".trajstore-tmp").mkdir(exist_ok=True)
    (tmp_path / "r" / ".trajstore-tmp" / "0123abcd").write_bytes(good)
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 0 and "replaced the damaged commit record by a complete one" in out
    assert _verify(capsys, str(tmp_path / "r"))[0] == 0
    with ReplayBuffer.load_from(tmp_path / "r", read_only=True) as rb:
        assert len(rb) == 3000


def test_garbage_commit_record_of_an_empty_store_is_rebuilt(tmp_path: Path, capsys) -> None:
    ReplayBuffer.create(STEP, cache_path=tmp_path / "e").close()
    (tmp_path / "e" / "trajstore.head.json").write_text("{}")
    assert _verify(capsys, str(tmp_path / "e"))[0] == 1
    code, out, _ = cli(capsys, "repair", str(tmp_path / "e"))
    assert code == 0 and "wrote an empty commit record" in out
    with ReplayBuffer.load_from(tmp_path / "e") as rb:
        assert len(rb) == 0


def test_removed_root_metadata(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r")
    os.remove(tmp_path / "r" / "zarr.json")
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 1
    assert out.splitlines()[0] == ("FAULT root-missing: zarr.json: the root metadata (schema and spaces) is missing; "
                                   "the store cannot be opened")
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 1 and "recovery impossible: the root or array metadata" in out


def test_damage_on_a_memory_store(capsys) -> None:
    from trajstore.storage.location import resolve_location

    url = memory_url()
    make_traj(url, compressor="lz4")
    loc = resolve_location(url, read_only=False, must_exist=True)
    # Commit record garbage: found, and not recoverable (there is data).
    good = loc.get("trajstore.head.json")
    loc.put("trajstore.head.json", b"[1, 2")
    assert _verify(capsys, url)[1].startswith("FAULT head-unreadable")
    assert cli(capsys, "repair", url)[0] == 1
    loc.put("trajstore.head.json", good)
    # A missing compressed chunk of the ring: repair keeps the longest intact run.
    loc.delete("step_data/obs/c/0/0")
    code, out = _verify(capsys, url)
    assert code == 1 and "FAULT missing-chunk: step_data/obs/c/0/0: chunk missing; table 'step_data' rows [0, 1024) are lost" in out
    code, out, _ = cli(capsys, "repair", url)
    assert code == 0 and "dropped damaged or missing rows [0, 1024)" in out
    tb = TrajectoryReplayBuffer.load_from(url, read_only=True)
    assert len(tb) == 3000 - 1024 and tb.offset == 1024
    assert _verify(capsys, url)[0] == 0
    tb.close()
    # Root metadata removed: found through the URL as well.
    loc.delete("zarr.json")
    code, out = _verify(capsys, url)
    assert code == 1 and out.startswith("FAULT root-missing: zarr.json")


def test_deep_verify_decodes_chunks_and_repair_deep_rolls_back(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r", compressor="lz4")
    chunk = tmp_path / "r" / "step_data" / "reward" / "c" / "2"
    chunk.write_bytes(os.urandom(chunk.stat().st_size))
    assert _verify(capsys, str(tmp_path / "r"))[0] == 0  # same size: only decoding finds it
    code, out = _verify(capsys, str(tmp_path / "r"), "--deep")
    assert code == 1 and "FAULT undecodable-chunk: step_data/reward/c/2: chunk does not decode" in out
    assert "rows [2048, 3000) are damaged" in out
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"), "--deep")
    assert code == 0 and "dropped damaged or missing rows [2048, 3000)" in out
    assert _verify(capsys, str(tmp_path / "r"), "--deep")[0] == 0


def test_repair_removes_orphans_and_uncommitted_chunks(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r")
    root = tmp_path / "r"
    (root / ".trajstore-tmp").mkdir(exist_ok=True)
    (root / ".trajstore-tmp" / "deadbeef").write_bytes(b"x" * 10)
    (root / ".trajstore-staging" / "7" / "step_data" / "obs" / "c" / "0").mkdir(parents=True)
    (root / ".trajstore-staging" / "7" / "step_data" / "obs" / "c" / "0" / "0").write_bytes(b"y")
    (root / "step_data" / "obs" / "c" / "3").mkdir()
    (root / "step_data" / "obs" / "c" / "3" / "0").write_bytes(bytes(69632))  # beyond the committed rows
    code, out = _verify(capsys, str(root))
    assert code == 0 and "2 orphaned temp/staging file(s)" in out and "1 chunk(s) hold no committed row" in out
    rep = json.loads(cli(capsys, "repair", str(root), "--dry-run", "--json")[1])
    assert {c["key"] for c in rep["changes"]} == {".trajstore-tmp/deadbeef", ".trajstore-staging/7/step_data/obs/c/0/0",
                                                  "step_data/obs/c/3/0"}
    assert (root / "step_data" / "obs" / "c" / "3" / "0").exists()  # dry run
    code, out, _ = cli(capsys, "repair", str(root))
    assert code == 0 and "deleted step_data/obs/c/3/0: uncommitted chunk" in out
    assert "deleted .trajstore-tmp/deadbeef: temp file of a writer" in out
    assert not (root / "step_data" / "obs" / "c" / "3").exists() or not any((root / "step_data" / "obs" / "c" / "3").iterdir())
    assert not (root / ".trajstore-staging").exists()
    code, out = _verify(capsys, str(root))
    assert code == 0 and "note:" not in out


def test_repair_refuses_a_store_a_writer_holds(tmp_path: Path, capsys) -> None:
    make_rb(tmp_path / "r")
    rb = ReplayBuffer.load_from(tmp_path / "r")
    try:
        code, _out, err = cli(capsys, "repair", str(tmp_path / "r"))
        assert code == 1 and "a writer has the store open" in err
    finally:
        rb.close()


def test_stale_array_shape_is_found_and_fixed(tmp_path: Path, capsys) -> None:
    """A zarr.json shape short of the committed rows (a writer killed between its commit record
    and publishing the shape) is harmless for trajstore, a note; repair publishes the shape."""
    import zarr

    make_rb(tmp_path / "r")
    meta_path = tmp_path / "r" / "step_data" / "obs" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][0] = 1024
    meta_path.write_text(json.dumps(meta))
    code, out = _verify(capsys, str(tmp_path / "r"))
    assert code == 0 and ("step_data/obs/zarr.json: shape records 1024 rows but table 'step_data' "
                          "commits 3000") in out
    code, out, _ = cli(capsys, "repair", str(tmp_path / "r"))
    assert code == 0 and "resized step_data/obs/zarr.json: recorded shape 1024 -> 3000 rows" in out
    g = zarr.open_group(str(tmp_path / "r"), mode="r")
    np.testing.assert_array_equal(g["step_data/obs"][:3000], _episode_rows()["obs"])


# -- copy ---------------------------------------------------------------------------------------------------
def test_copy_local_memory_zip_and_relayout(tmp_path: Path, capsys) -> None:
    import zarr

    make_traj(tmp_path / "t")
    src = TrajectoryReplayBuffer.load_from(tmp_path / "t", read_only=True)
    want = src[:]
    want_eps = src.episodes()
    mem = memory_url()
    targets = [
        (mem, []),  # byte copy to memory
        (str(tmp_path / "c.zip"), []),  # byte copy into a zip
        (str(tmp_path / "z"), ["--compressor", "zstd", "--chunk-rows", "256"]),  # recompress and rechunk
        (str(tmp_path / "z.zip"), ["--compressor", "lz4"]),  # relayout into a zip
    ]
    for dst, extra in targets:
        out = cli_json(capsys, "copy", str(tmp_path / "t"), dst, *extra)
        # "rows" are step rows (it was step rows + episode-data rows); each table's rows apart
        assert out["verified"] is True and out["rows"] == 3000
        assert out["table_rows"] == {"step_data": 3000, "episode_data": 5}
        assert out["method"] == ("zip" if dst.endswith(".zip") else "relayout" if extra else "byte copy")
        with TrajectoryReplayBuffer.load_from(dst, read_only=True) as tb:
            got = tb[:]
            np.testing.assert_array_equal(got["step_data"]["obs"], want["step_data"]["obs"])
            np.testing.assert_array_equal(got["episode_data"], want["episode_data"])
            for k, v in tb.episodes().items():
                np.testing.assert_array_equal(v, want_eps[k])
            assert tb.current_episode_id == src.current_episode_id
        assert _verify(capsys, dst, "--deep")[0] == 0
    assert "zstd" in json.dumps(zarr.open_array(str(tmp_path / "z"), path="step_data/obs", mode="r").metadata.to_dict())
    assert zarr.open_array(str(tmp_path / "z"), path="step_data/obs", mode="r").chunks[0] == 256
    # Back from memory to a local folder, and refusing to overwrite.
    assert cli(capsys, "copy", mem, str(tmp_path / "back"))[0] == 0
    code, _o, err = cli(capsys, "copy", mem, str(tmp_path / "back"))
    assert code == 1 and "--overwrite" in err
    assert cli(capsys, "copy", mem, str(tmp_path / "back"), "--overwrite", "--compressor", "none")[0] == 0
    with TrajectoryReplayBuffer.load_from(tmp_path / "back", read_only=True) as tb:
        np.testing.assert_array_equal(tb[:]["step_data"]["reward"], want["step_data"]["reward"])
    src.close()


def test_a_copy_that_does_not_verify_fails_with_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """``copy`` verifies what it wrote last (``verify_copy``, the helper that combine, split,
    filter and imports use as ``verify_written``): a copy damaged after the row comparison exits
    with status 1 and one line naming the first fault; the library helper raises
    DamagedStoreError naming the store for the same fault."""
    from trajstore.cli import maintain
    from trajstore.errors import DamagedStoreError
    from trajstore.maintenance.staged import verify_written

    make_rb(tmp_path / "r")
    dst = tmp_path / "c"
    real_compare = maintain._compare

    damaged = tmp_path / "damaged"

    def compare_then_truncate(source, copy, bar, *rest):  # the real comparison, then real damage on disk
        n = real_compare(source, copy, bar, *rest)
        built = copy.loc.local_root  # the copy is built beside dst and published once it verifies
        assert built.parent == tmp_path and built.name.startswith(".c.trajstore-partial-")
        with open(built / "step_data" / "obs" / "c" / "2" / "0", "r+b") as f:
            f.truncate(100)
        shutil.copytree(built, damaged)
        return n

    monkeypatch.setattr(maintain, "_compare", compare_then_truncate)
    code, out, err = cli(capsys, "copy", str(tmp_path / "r"), str(dst))
    fault = ("step_data/obs/c/2/0: truncated chunk file (100 of 69632 bytes); table 'step_data' rows [2048, 3000) "
             "are damaged")
    assert code == 1 and err == f"trajstore copy: error: copy verification failed: {fault}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "r"]  # no copy published, nothing left beside
    with pytest.raises(DamagedStoreError) as e:
        verify_written(str(damaged))
    assert str(e.value) == f"{damaged}: the written store does not verify: {fault}"


def test_copy_a_replay_buffer_ring(tmp_path: Path, capsys) -> None:
    space = gym.spaces.Dict({"x": gym.spaces.Box(-1, 1, (3,), np.float32), "a": gym.spaces.Discrete(4)})
    with ReplayBuffer.create(space, cache_path=tmp_path / "s", capacity=100) as rb:
        for i in range(130):
            rb.append({"x": np.full(3, i / 200, np.float32), "a": i % 4})
    code, out, err = cli(capsys, "copy", str(tmp_path / "s"), str(tmp_path / "d"), "--compressor", "lz4")
    assert code == 0, err
    assert "the copy matches the source and verifies" in out
    with ReplayBuffer.load_from(tmp_path / "s", read_only=True) as a, ReplayBuffer.load_from(tmp_path / "d", read_only=True) as b:
        assert len(a) == len(b) == 100 and b.capacity == 100
        np.testing.assert_array_equal(a[:]["x"], b[:]["x"])


# -- plot -------------------------------------------------------------------------------------------------------
def test_plot_writes_a_png(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    make_rb(tmp_path / "r")
    code, out, err = cli(capsys, "plot", str(tmp_path / "r"), "-o", str(tmp_path / "p.png"))
    assert code == 0, err
    assert "wrote" in out
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image as mpimg

    img = mpimg.imread(str(tmp_path / "p.png"))
    assert img.shape[0] > 100 and img.shape[1] > 100


# -- conventions ------------------------------------------------------------------------------------------------
def test_errors_are_one_line_with_exit_status(tmp_path: Path) -> None:
    out = run_cli("info", str(tmp_path / "missing"))
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "no store at" in out.stderr
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.txt").write_text("hi")
    out = run_cli("info", str(tmp_path / "junk"))
    assert out.returncode == 1 and "not a trajstore store" in out.stderr
    out = run_cli("frobnicate")
    assert out.returncode == 2
    out = run_cli("info", str(tmp_path / "junk"), "--storage-options", "{nope")
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    out = run_cli("verify", str(tmp_path / "junk"), "--debug")
    assert out.returncode == 1 and "Traceback" in out.stderr and "NotATrajstoreError" in out.stderr


def test_help_reads_well(capsys) -> None:
    commands = ["info", "ls", "episodes", "head", "stats", "verify", "repair", "copy", "plot", "view", "demo"]
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for c in commands:
        assert f"\n    {c} " in text
    assert "exit status: 0 ok, 1 a problem was found" in text
    for c in commands:
        with pytest.raises(SystemExit) as e:
            main([c, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: trajstore {c}") and "--debug" in text


def test_progress_bars_stay_silent_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    make_rb(tmp_path / "r")
    out = run_cli("verify", str(tmp_path / "r"), "--deep")
    assert out.returncode == 0 and out.stderr == ""
    out = run_cli("copy", str(tmp_path / "r"), str(tmp_path / "c"), "--compressor", "lz4", "--json")
    assert out.returncode == 0 and out.stderr == "" and json.loads(out.stdout)["verified"] is True


def test_read_only_commands_write_nothing(tmp_path: Path, capsys) -> None:
    make_traj(tmp_path / "t")

    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "t").rglob("*")}

    before = snapshot()
    for args in (["info"], ["ls"], ["episodes"], ["head"], ["stats"], ["verify", "--deep"], ["repair", "--dry-run"]):
        assert cli(capsys, args[0], str(tmp_path / "t"), *args[1:])[0] == 0
    assert snapshot() == before
