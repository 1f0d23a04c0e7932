"""Robot-learning metadata (issue 32 points 2-4, docs/robot.md): time windows in seconds with a
tolerance, streams at other rates, tasks (filter, rename, reassign, crash safe) and stored
statistics (exact moments, quantiles within their documented rank error, hostile stats files)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _robot_workers as RW  # noqa: E402
import _workers as W  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.errors import (  # noqa: E402
    BadOptionError,
    DamagedStoreError,
    ReadOnlyError,
    TimeOrderError,
    UnknownEpisodeError,
    UnknownFieldError,
    UnknownTaskError,
)
from trajstore.maintenance.combine import filter_store  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.storage.robot_files import STAT_WIDTH  # noqa: E402

SPACE = Dict({"timestamp": Box(0, 1e9, (), np.float64), "state": Box(-100, 100, (3,), np.float32),
              "image": Box(0, 255, (6, 5, 3), np.uint8)})


def _record(path: str | None, lengths=(20, 21, 22), hz: float = 10.0, seed: int = 0) -> TrajectoryReplayBuffer:
    """Episodes of ``lengths`` steps at ``hz``; state[0] holds the step's time (for checking)."""
    rng = np.random.default_rng(seed)
    tb = TrajectoryReplayBuffer.create(SPACE, cache_path=path)
    for n in lengths:
        ts = np.arange(n) / hz
        state = rng.normal(size=(n, 3)).astype(np.float32)
        state[:, 0] = ts
        tb.extend({"timestamp": ts, "state": state, "image": rng.integers(0, 256, (n, 6, 5, 3), dtype=np.uint8)})
        tb.mark_episode_end()
    return tb


def _hashes(root: str) -> dict[str, str]:
    out = {}
    for d, _s, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


# -- time ------------------------------------------------------------------------------------------
def test_time_windows_pad_out_of_tolerance_frames_and_never_replace_silently(tmp_path):
    tb = _record(str(tmp_path / "s"))
    # Anchors: row 0 (episode 0, t=0), row 5 (t=0.5), row 20 (episode 1, t=0), row 62 (episode 2, last, t=2.1).
    w = tb.get_time_windows([0, 5, 20, 62], {"state": [-0.1, 0.0, 0.1], "image": [0.0, 0.05]}, tolerance_s=0.01)
    assert w["state"].shape == (4, 3, 3) and w["image"].shape == (4, 2, 6, 5, 3)
    assert w["state_is_pad"].tolist() == [[True, False, False], [False, False, False], [True, False, False],
                                          [False, False, True]]
    # A padded frame holds the episode's nearest step and is flagged; every other frame is at its time.
    np.testing.assert_allclose(w["state"][:, :, 0], [[0, 0, 0.1], [0.4, 0.5, 0.6], [0, 0, 0.1], [2.0, 2.1, 2.1]],
                               atol=1e-6)
    assert w["image_is_pad"][:, 1].all() and not w["image_is_pad"][:, 0].any()  # 0.05 s lies between two frames
    loose = tb.get_time_windows([5], {"image": [0.05]}, tolerance_s=0.05)
    assert not loose["image_is_pad"].any()
    # previous: the latest step at or before the time.
    prev = tb.get_time_windows([5], {"state": [0.07, -0.5, -0.51]}, tolerance_s=0.1, mode="previous")
    np.testing.assert_allclose(prev["state"][0, :, 0], [0.5, 0.0, 0.0], atol=1e-6)
    assert prev["state_is_pad"].tolist() == [[False, False, True]]
    with pytest.raises(BadOptionError, match="within"):
        tb.get_time_windows([0], {"state": [-0.1]}, on_missing="raise")
    with pytest.raises(BadOptionError, match="tolerance_s"):
        tb.get_time_windows([0], {"state": [0.0]}, tolerance_s=-1e-3)
    with pytest.raises(UnknownFieldError):
        tb.get_time_windows([0], {"nope": [0.0]})
    s = tb.sample_time_windows(8, {"state": [0.0]}, rng=0)
    assert s["state"].shape == (8, 1, 3) and not s["state_is_pad"].any()
    tb.close()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("mode", ["nearest", "previous"])
def test_time_windows_match_a_brute_force_search_on_irregular_timestamps(tmp_path, mode, interleaved):
    rng = np.random.default_rng(5)
    space = Dict({"timestamp": Box(0, 1e9, (), np.float64), "v": Box(-1e9, 1e9, (), np.float64)})
    tb = TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"))
    times = {e: np.cumsum(rng.exponential(0.02, size=int(rng.integers(5, 40)))) for e in range(6)}
    if interleaved:  # two episodes' steps alternate: each episode is several runs of rows
        for k in range(40):
            for e in (0, 1):
                if k < len(times[e]):
                    tb.extend({"step_data": {"timestamp": times[e][k:k + 1], "v": times[e][k:k + 1]},
                               "episode_ids": np.array([e])})
    for e in range(2 if interleaved else 0, 6):
        tb.extend({"step_data": {"timestamp": times[e], "v": times[e]}, "episode_ids": np.full(len(times[e]), e)})
    deltas = rng.uniform(-0.1, 0.1, size=7)
    anchors = rng.integers(0, len(tb), size=50)
    w = tb.get_time_windows(anchors, {"v": deltas}, tolerance_s=0.01, mode=mode)
    data, meta = tb.get_at_with_metadata(anchors)
    for b, (eid, t0) in enumerate(zip(meta["episode_ids"], data["step_data"]["timestamp"])):
        ts = times[int(eid)]
        for k, d in enumerate(deltas):
            t = t0 + d
            if mode == "nearest":
                j = int(np.argmin(np.abs(ts - t)))
                ok = abs(ts[j] - t) <= 0.01
            else:
                j = int(np.searchsorted(ts, t + 1e-9, side="right")) - 1
                ok = j >= 0 and t - ts[j] <= 0.01
            assert w["v_is_pad"][b, k] == (not ok)
            if ok:
                assert w["v"][b, k] == ts[j]
    tb.close()


def test_fps_without_timestamps_and_no_time_at_all(tmp_path):
    space = Dict({"state": Box(-1e9, 1e9, (), np.float64)})
    tb = TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"))
    tb.extend({"state": np.arange(10.0)})
    tb.mark_episode_end()
    with pytest.raises(BadOptionError, match="no time"):
        tb.get_time_windows([0], {"state": [0.0]})
    tb.set_fps(50)
    w = tb.get_time_windows([3, 9], {"state": [-0.04, 0.0, 0.02, 0.03]}, tolerance_s=1e-4)
    assert w["state"].tolist() == [[1, 3, 4, 4], [7, 9, 9, 9]]
    assert w["state_is_pad"].tolist() == [[False, False, False, True], [False, False, True, True]]
    tb.close()
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        assert ro.fps == 50.0
        with pytest.raises(ReadOnlyError):
            ro.set_fps(30)
    with pytest.raises(BadOptionError):
        TrajectoryReplayBuffer.load_from(str(tmp_path / "s")).set_fps(-1)


def test_streams_at_other_rates_read_at_the_cameras_times(tmp_path):
    cam = _record(str(tmp_path / "cam"), lengths=(30, 30), hz=30.0)
    joints = TrajectoryReplayBuffer.create(Dict({"timestamp": Box(0, 1e9, (), np.float64),
                                                 "pos": Box(-1e9, 1e9, (), np.float64)}), cache_path=str(tmp_path / "j"))
    for _ in range(2):  # 500 Hz, starting 1 ms after the camera; pos = its own time
        ts = 0.001 + np.arange(500) / 500
        joints.extend({"timestamp": ts, "pos": ts})
        joints.mark_episode_end()
    w = cam.get_time_windows([10, 40], {"state": [0.0], "joints/pos": [0.0, -0.01]}, tolerance_s=0.002,
                             streams={"joints": joints})
    t_cam = np.array([10 / 30, 10 / 30])
    near = 0.001 + np.round((t_cam - 0.001) * 500) / 500
    np.testing.assert_allclose(w["joints/pos"][:, 0], near)
    assert not w["joints/pos_is_pad"].any()
    prev = cam.get_time_windows([0], {"joints/pos": [0.0, 0.01]}, tolerance_s=0.002, mode="previous",
                                streams={"joints": joints})
    # At t=0 no joint sample lies at or before: padded; at 0.01 the previous is 0.009.
    assert prev["joints/pos_is_pad"].tolist() == [[True, False]]
    np.testing.assert_allclose(prev["joints/pos"][0, 1], 0.009)
    cam.close()
    joints.close()


def test_timestamps_out_of_order_are_refused_before_any_byte_is_written(tmp_path):
    path = str(tmp_path / "s")
    _record(path).close()
    tb = TrajectoryReplayBuffer.load_from(path)
    before = _hashes(path)
    bad = {"timestamp": np.array([0.0, 0.2, 0.1]), "state": np.zeros((3, 3), np.float32),
           "image": np.zeros((3, 6, 5, 3), np.uint8)}
    with pytest.raises(TimeOrderError, match="step 2"):
        tb.extend(bad)
    tb.extend({**bad, "timestamp": np.array([0.0, 0.1, 0.1])})  # equal times are allowed
    with pytest.raises(TimeOrderError):  # and the episode continues from its last time
        tb.extend({**bad, "timestamp": np.array([0.05, 0.2, 0.3])})
    assert len(tb) == 66
    tb.close()
    assert TimeOrderError.__mro__[1].__name__ == "BadValueError"
    assert set(before) <= set(_hashes(path))


# -- tasks -----------------------------------------------------------------------------------------
def test_tasks_assign_rename_filter_and_refusals(tmp_path):
    path = str(tmp_path / "s")
    tb = _record(path, lengths=(5, 6, 7, 8))
    assert tb.assign_task([0, 2], "pick cube") == 0
    assert tb.assign_task(1, "place cube") == 1
    assert tb.assign_task([3], 0) == 0  # by index
    tb.rename_task("place cube", "stack")
    assert tb.tasks == ["pick cube", "stack"] and tb.episode_tasks() == {0: "pick cube", 1: "stack", 2: "pick cube",
                                                                           3: "pick cube"}
    before = _hashes(path)
    with pytest.raises(UnknownTaskError):
        tb.rename_task("nope", "x")
    with pytest.raises(UnknownTaskError):
        tb.assign_task([0], 7)
    with pytest.raises(UnknownTaskError):
        tb.assign_task([0], "new", new=False)
    with pytest.raises(UnknownEpisodeError):
        tb.assign_task([99], "pick cube")
    with pytest.raises(BadOptionError):
        tb.rename_task("stack", "pick cube")
    assert tb.task_names(np.array([1, 0, 1])).tolist() == ["stack", "pick cube", "stack"]
    for bad in ([2], [-1], [0.5]):
        with pytest.raises(UnknownTaskError):
            tb.task_names(bad)
    assert tb.episodes_with_task("pick cube").tolist() == [0, 2, 3]
    with pytest.raises(UnknownTaskError):
        tb.episodes_with_task("nope")
    assert _hashes(path) == before
    tb.assign_task([], "pick cube")  # nothing to assign
    tb.remove_episodes([3])
    assert 3 not in tb.episode_tasks()
    tb.assign_task([2], "pick cube")
    assert 3 not in tb.robot_info().episode_tasks  # dropped from the file at the next edit
    tb.set_fps(10)
    tb.close()
    out = filter_store(path, str(tmp_path / "f"), "task == 'pick cube' and length > 5")
    assert out["episodes"] == 1
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "f"), read_only=True) as f:
        assert f.episode_tasks() == {2: "pick cube"} and f.fps == 10.0
    with pytest.raises(UnknownTaskError, match="the tasks are"):
        filter_store(path, str(tmp_path / "g"), "task == 'pick cubes'")
    for expr in ("task == 1", "length == 'pick cube'", "task == length"):
        with pytest.raises(BadOptionError, match="text"):
            filter_store(path, str(tmp_path / "g"), expr)
    assert not os.path.exists(tmp_path / "g")


def test_split_keeps_and_combine_merges_tasks(tmp_path):
    from trajstore.maintenance.combine import combine, split

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ta = _record(a, lengths=(3, 4, 5, 6))
    ta.assign_task([0, 1], "pick")
    ta.assign_task([2, 3], "place")
    ta.set_fps(10)
    ta.close()
    tb = _record(b, lengths=(3, 3))
    tb.assign_task([0], "place")
    tb.assign_task([1], "wipe")
    tb.set_fps(10)
    tb.close()
    out = split(a, {"x": 0.5, "y": 0.5}, str(tmp_path / "s_"), seed=1)
    for name, rep in out["splits"].items():
        with TrajectoryReplayBuffer.load_from(rep["destination"], read_only=True) as ro:
            want = {e: ("pick" if e < 2 else "place") for e in rep["episode_ids"]}
            assert ro.episode_tasks() == want and ro.fps == 10.0
    combine([a, b], str(tmp_path / "c"))
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "c"), read_only=True) as ro:
        assert ro.tasks == ["pick", "place", "wipe"]
        assert ro.episode_tasks() == {0: "pick", 1: "pick", 2: "place", 3: "place", 4: "place", 5: "wipe"}
    with TrajectoryReplayBuffer.load_from(b) as w:
        w.set_fps(30)
    with pytest.raises(BadOptionError, match="frame rates"):
        combine([a, b], str(tmp_path / "d"))
    assert not os.path.exists(tmp_path / "d")


def test_cli_task_and_stats(tmp_path, capsys):
    from trajstore.cli import main

    path = str(tmp_path / "s")
    tb = _record(path)
    tb.assign_task([0, 1, 2], "pick cube")
    tb.close()

    def cli(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        got = capsys.readouterr()
        return code, got.out, got.err

    code, out, err = cli("task", "rename", path, "pick cube", "lift", "--json")
    assert code == 0, err
    assert json.loads(out) == {"tasks": ["lift"], "episodes": {"0": "lift", "1": "lift", "2": "lift"}}
    code, out, _ = cli("task", "assign", path, "push", "--episodes", "2")
    assert code == 0 and "push" in out
    code, _, err = cli("task", "rename", path, "nope", "x")
    assert code == 1 and "no task 'nope'" in err
    code, out, err = cli("filter", path, str(tmp_path / "f"), "--where", "task == 'push'", "--json")
    assert code == 0 and json.loads(out)["episodes"] == 1, err
    code, out, _ = cli("stats", path, "--save")
    assert code == 0 and "3 episodes" in out
    code, out, _ = cli("stats", path, "--episodes", "0,1", "--field", "state", "--json")
    got = json.loads(out)["state"]
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        want = ro.stats([0, 1], fields=["state"])["state"]
    assert np.allclose(got["q50"], want["q50"]) and got["count"] == 41
    code, out, _ = cli("stats", path, "--episodes", "all")
    assert code == 0 and "image[2]" in out and "q99" in out


def test_sigkill_during_task_edits_and_stats_saves(tmp_path):
    store = str(tmp_path / "store")
    tb = _record(store, lengths=(4, 5, 6, 4, 5, 6))
    tb.assign_task(range(6), "start")
    tb.close()
    rng = np.random.default_rng(3)
    for r in range(6):
        ready = str(tmp_path / f"ready{r}")
        p = W.start(RW.edit_robot_loop, store, ready, r)
        try:
            W.wait_for_file(ready, p)
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            W.kill(p)
        assert verify_store(store).ok, f"round {r}"
        with TrajectoryReplayBuffer.load_from(store, read_only=True) as ro:
            tasks = ro.episode_tasks()
            assert sorted(tasks) == list(range(6)) and set(tasks.values()) <= set(ro.tasks), f"round {r}"
            assert ro.stats([0])["state"]["count"] == 4
        with TrajectoryReplayBuffer.load_from(store) as w:  # the next writer edits on
            w.rename_task(w.tasks[0], "start")


# -- statistics -------------------------------------------------------------------------------------
def test_stats_per_episode_exact_and_aggregated_within_the_documented_rank_error(tmp_path):
    rng = np.random.default_rng(1)
    tb = TrajectoryReplayBuffer.create(SPACE, cache_path=str(tmp_path / "s"))
    lengths = (200, 300, 250)
    for k, n in enumerate(lengths):
        state = (rng.normal(size=(n, 3)) * (k + 1) + 3 * k).astype(np.float32)  # episodes differ
        tb.extend({"timestamp": np.arange(n) / 10, "state": state,
                   "image": rng.integers(0, 50 * (k + 1), (n, 6, 5, 3), dtype=np.uint8)})
        tb.mark_episode_end()
    states = tb[:]["step_data"]["state"].astype(np.float64)
    images = tb[:]["step_data"]["image"]
    one = tb.stats([1])
    x = states[200:500]
    for name, q in (("q01", 0.01), ("q10", 0.1), ("q50", 0.5), ("q90", 0.9), ("q99", 0.99)):
        np.testing.assert_allclose(one["state"][name], np.quantile(x, q, axis=0), rtol=1e-6)
    im = images[200:500].reshape(-1, 3).astype(np.float64)
    assert one["image"]["mean"].shape == (1, 1, 3)
    np.testing.assert_allclose(one["image"]["q50"].ravel(), np.quantile(im, 0.5, axis=0))
    np.testing.assert_allclose(one["image"]["std"].ravel(), im.std(0), rtol=1e-9)
    every = tb.stats()
    assert every["state"]["count"] == 750
    np.testing.assert_allclose(every["state"]["mean"], states.mean(0), rtol=1e-9)
    np.testing.assert_allclose(every["state"]["std"], states.std(0), rtol=1e-9)
    np.testing.assert_allclose(every["state"]["min"], states.min(0))
    for name, q in (("q01", 0.01), ("q10", 0.1), ("q50", 0.5), ("q90", 0.9), ("q99", 0.99)):
        rank = (states <= every["state"][name]).mean(0)  # the true rank of the merged quantile
        assert (np.abs(rank - q) <= 0.01 + 1 / min(lengths)).all(), (name, rank)
    exact = tb.stats(exact=True)
    np.testing.assert_allclose(exact["state"]["q50"], np.quantile(states, 0.5, axis=0), rtol=1e-9)
    with pytest.raises(UnknownEpisodeError):
        tb.stats([9])
    from trajstore.sampling.field_stats import StatField

    shapes = {(64, 48, 3): (1, 1, 3), (3, 64, 48): (3, 1, 1), (5, 5, 1): (1, 1, 1), (4, 4, 3): (4, 4, 3),
              (14,): (14,), (): (), (100, 100): ()}
    for shape, want in shapes.items():
        assert StatField("f", 0, shape, np.dtype(np.float32)).stat_shape == want, shape
    with pytest.raises(UnknownFieldError):
        tb.stats(fields=["nope"])
    tb.close()


def test_saved_stats_are_used_while_current_and_damaged_files_are_refused(tmp_path):
    path = str(tmp_path / "s")
    tb = _record(path)
    fresh = tb.stats()
    tb.close(save_stats=True)
    stats_file = os.path.join(path, "trajstore.stats")
    raw = open(stats_file, "rb").read()
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        np.testing.assert_allclose(ro.stats()["state"]["q50"], fresh["state"]["q50"])
    # Proof the stored numbers are read: a doctored (well-formed) mean of episode 0 shows.
    hlen = int.from_bytes(raw[8:16], "little")
    vals = np.frombuffer(raw, "<f8", offset=16 + hlen + 16 * 3).copy().reshape(3, -1, STAT_WIDTH)
    header = json.loads(raw[16:16 + hlen])
    at = 0
    for name, channels in header["fields"]:
        if name == "state":
            break
        at += channels
    vals[0, at, 1] = 1e6  # episode 0, state[0]: its mean
    open(stats_file, "wb").write(raw[:16 + hlen + 48] + vals.astype("<f8").tobytes())
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        assert ro.stats([0])["state"]["mean"][0] == 1e6
    # Appending to an episode makes its stored statistics stale: they are computed again.
    with TrajectoryReplayBuffer.load_from(path) as tb:
        tb.extend({"timestamp": np.array([99.0]), "state": np.zeros((1, 3), np.float32),
                   "image": np.zeros((1, 6, 5, 3), np.uint8)})
        assert tb.stats([3])["state"]["count"] == 1 and tb.stats([0])["state"]["mean"][0] == 1e6
    hostile = {
        "magic": b"XXXXXXXX" + raw[8:],
        "truncated": raw[:-8],
        "longer": raw + b"\0" * 8,
        "huge header": raw[:8] + (1 << 40).to_bytes(8, "little") + raw[16:],
        "nan count": raw[:16 + hlen + 48] + np.full(vals.size, np.nan).tobytes(),
        "quantiles out of order": raw[:16 + hlen + 48] + np.concatenate(
            [vals[..., :5], vals[..., 5:][..., ::-1]], -1).astype("<f8").tobytes(),
        "header not json": raw[:16] + b"{" * hlen + raw[16 + hlen:],
    }
    for what, data in hostile.items():
        open(stats_file, "wb").write(data)
        with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
            with pytest.raises(DamagedStoreError, match="trajstore.stats"):
                ro.stats()
        assert not verify_store(path).ok, what
    from trajstore.maintenance.repair import repair_store

    assert repair_store(path).recovered and not os.path.exists(stats_file)  # derived data: removed
    assert verify_store(path).ok
    os.symlink(os.path.join(str(tmp_path), "elsewhere"), stats_file)
    open(tmp_path / "elsewhere", "wb").write(raw)
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        with pytest.raises(DamagedStoreError):
            ro.stats()
    os.remove(stats_file)


def test_saved_stats_of_tied_values_always_read_back(tmp_path):
    """Many ties (a few distinct values): every stored percentile grid is in order as written."""
    rng = np.random.default_rng(2)
    space = Dict({"u": Box(0, 3, (7,), np.uint8), "f": Box(-2, 2, (5,), np.float32), "b": Box(0, 1, (), np.bool_)})
    tb = TrajectoryReplayBuffer.create(space, cache_path=str(tmp_path / "s"))
    for n in (1, 2, 7, 33):
        tb.extend({"u": rng.integers(0, 4, (n, 7), dtype=np.uint8),
                   "f": rng.integers(-2, 3, (n, 5)).astype(np.float32) / 3, "b": rng.random(n) < 0.3})
        tb.mark_episode_end()
    tb.close(save_stats=True)
    with TrajectoryReplayBuffer.load_from(str(tmp_path / "s"), read_only=True) as ro:
        s = ro.stats()
        assert s["u"]["q50"].shape == (7,) and s["b"]["max"] <= 1
        assert verify_store(str(tmp_path / "s")).ok


@pytest.mark.parametrize("text", [
    b"[]", b'{"version": 2, "fps": null, "tasks": [], "episode_tasks": []}',
    b'{"version": 1, "fps": -3, "tasks": [], "episode_tasks": []}',
    b'{"version": 1, "fps": null, "tasks": ["a", "a"], "episode_tasks": []}',
    b'{"version": 1, "fps": null, "tasks": ["a"], "episode_tasks": [[0, 1]]}',
    b'{"version": 1, "fps": NaN, "tasks": [], "episode_tasks": []}', b"\xff\xfe",
])
def test_hostile_robot_file_is_a_damaged_store_error(tmp_path, text):
    path = str(tmp_path / "s")
    _record(path, lengths=(3,)).close()
    open(os.path.join(path, "trajstore.robot.json"), "wb").write(text)
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        with pytest.raises(DamagedStoreError, match="trajstore.robot.json"):
            ro.tasks
    assert not verify_store(path).ok


def test_robot_file_that_is_a_link_a_fifo_or_too_big_is_refused(tmp_path):
    path = str(tmp_path / "s")
    _record(path, lengths=(3,)).close()
    target = os.path.join(path, "trajstore.robot.json")
    outside = tmp_path / "outside.json"
    outside.write_text('{"version": 1, "fps": 5, "tasks": [], "episode_tasks": []}')
    os.symlink(outside, target)
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        with pytest.raises(DamagedStoreError):
            ro.fps
    os.remove(target)
    os.mkfifo(target)
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        with pytest.raises(DamagedStoreError):
            ro.fps
    os.remove(target)
    with open(target, "wb") as f:
        f.write(b'{"version": 1, "fps": 5, "tasks": [], "episode_tasks": []}' + b" " * (17 << 20))
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        with pytest.raises(DamagedStoreError, match="bytes"):
            ro.fps
    os.remove(target)
    with TrajectoryReplayBuffer.load_from(path) as w:  # bad edits are refused before a byte is written
        before = _hashes(path)
        for bad in ("", "x" * 5000, "tab\there", 3.5):
            with pytest.raises(Exception) as e:
                w.assign_task([0], bad)  # type: ignore[arg-type]
            assert type(e.value).__module__ == "trajstore.errors"
        assert _hashes(path) == before  # (the writer's own commit at close aside)
    assert not os.path.exists(target)


def test_torch_datasets_normalize_by_the_stored_statistics(tmp_path):
    torch = pytest.importorskip("torch")
    from trajstore.torch import SequenceDataset, TransitionDataset

    path = str(tmp_path / "s")
    _record(path).close(save_stats=True)
    ds = TransitionDataset(path, fields=["state", "image"]).normalize({"state": "mean_std", "image": "min_max"})
    b = ds.read_batch(np.arange(len(ds)))
    assert b["state"].dtype == torch.float32
    np.testing.assert_allclose(b["state"].mean(0).numpy(), 0, atol=1e-5)
    np.testing.assert_allclose(b["state"].numpy().std(0), 1, atol=1e-4)
    assert b["image"].min() >= -1 and b["image"].max() <= 1
    loader = torch.utils.data.DataLoader(SequenceDataset(path, 4, fields=["state"]).normalize({"state": "quantile"}),
                                         batch_size=8, num_workers=1)
    first = next(iter(loader))
    assert first["state"].shape == (8, 4, 3) and first["state"].abs().max() < 2
    with pytest.raises(BadOptionError):
        ds.normalize({"state": "zscore"})


def test_time_window_dataset_in_dataloader_workers_with_a_stream(tmp_path):
    torch = pytest.importorskip("torch")
    from trajstore.torch import TimeWindowDataset

    cam = str(tmp_path / "cam")
    _record(cam, lengths=(10, 12), hz=10.0).close(save_stats=True)
    joints = TrajectoryReplayBuffer.create(Dict({"timestamp": Box(0, 1e9, (), np.float64),
                                                 "pos": Box(-1e9, 1e9, (), np.float64)}), cache_path=str(tmp_path / "j"))
    for _ in range(2):
        ts = np.arange(60) / 50
        joints.extend({"timestamp": ts, "pos": ts})
        joints.mark_episode_end()
    joints.close()
    ds = TimeWindowDataset(cam, {"state": [-0.1, 0.0], "joints/pos": [0.0, 0.02]}, tolerance_s=1e-3,
                           streams={"joints": str(tmp_path / "j")}).normalize({"state": "mean_std"})
    assert len(ds) == 22
    batches = list(torch.utils.data.DataLoader(ds, batch_size=11, num_workers=2))
    pos = torch.cat([b["joints/pos"] for b in batches])
    pad = torch.cat([b["state_is_pad"] for b in batches])
    assert pos.shape == (22, 2) and pad[:, 0].tolist() == [True] + [False] * 9 + [True] + [False] * 11
    expect = np.concatenate([np.arange(10), np.arange(12)]) / 10
    np.testing.assert_allclose(pos[:, 0].numpy(), expect)
    np.testing.assert_allclose(pos[:, 1].numpy(), expect + 0.02)
    assert batches[0]["state"].dtype == torch.float32
    with pytest.raises(BadOptionError):
        TimeWindowDataset(cam, {"state": [0.0]}, tolerance_s=-1)
