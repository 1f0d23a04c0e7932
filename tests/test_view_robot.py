"""``trajstore view`` over robot datasets (issues 32 and 34): tasks, frame rate, timestamps, stored
statistics, video fields and icechunk stores (a version included), over real HTTP on 127.0.0.1.

Real stores on disk (PNG-coded and H.264 video cameras, an icechunk repository), real encoders and
decoders; every store is hashed before and after its session: nothing is written.
"""

from __future__ import annotations

import json

import imagecodecs
import numpy as np
import pytest
from _view_stores import FPS, TASKS, get, get_json, image_store, serving, tree_hashes, video_store
from gymnasium.spaces import Box, Dict

from trajstore import TrajectoryReplayBuffer
from trajstore.cli import main


@pytest.fixture(scope="module")
def robot_store(tmp_path_factory):
    return image_store(tmp_path_factory.mktemp("view_robot") / "robot", episodes=4, length=6, robot=True)


def test_tasks_fps_and_stored_stats_are_shown_and_filtered(robot_store):
    before = tree_hashes(robot_store)
    with serving(robot_store) as s:
        ov = get_json(s, "/api/overview")[1]
        assert ov["robot"] == {"fps": FPS, "tasks": 3, "episodes_with_task": 4,
                               "stats": {"episodes": 4, "fields": ["action", "cam", "grey", "reward"], "current": True}}
        assert ov["task_dictionary"] == {"tasks": [{"index": 0, "task": TASKS[0], "episodes": 2},
                                                   {"index": 1, "task": TASKS[1], "episodes": 1},
                                                   {"index": 2, "task": TASKS[2], "episodes": 1}], "more": 0}
        page = get_json(s, "/api/episodes?where=" + "task == 'pick cube' and length > 3".replace(" ", "%20"))[1]
        col = page["columns"].index("task")
        assert page["matched"] == 2 and [r[0] for r in page["rows"]] == [0, 3] and {r[col] for r in page["rows"]} == {"pick cube"}
        status, err = get_json(s, "/api/episodes?where=task%20%3D%3D%20'pick%20cub'")
        assert status == 404 and err["type"] == "UnknownTaskError" and "no task 'pick cub'" in err["error"]
        page = get_json(s, "/api/episodes?sort=task&desc=1")[1]
        assert [r[col] for r in page["rows"]] == ["stack cubes", "place cube", "pick cube", "pick cube"]
        assert [r[0] for r in page["rows"]] == [2, 1, 0, 3]  # ties keep first-step order
        stats = get_json(s, "/api/stats")[1]
        ep = get_json(s, "/api/episode?id=1")[1]
    assert tree_hashes(robot_store) == before
    with TrajectoryReplayBuffer.load_from(robot_store, read_only=True) as buf:
        want = buf.stats()
    assert stats["stored"] and stats["episodes"] == stats["of"] == 4
    got = {f["field"]: f for f in stats["fields"]}
    assert got["cam"]["shape"] == [1, 1, 3] and got["cam"]["count"] == 24 and len(got["cam"]["channels"]) == 3
    np.testing.assert_allclose(np.array(got["action"]["channels"])[:, 0], want["action"]["mean"])
    np.testing.assert_allclose(np.array(got["cam"]["channels"])[:, 6], want["cam"]["q50"].ravel())
    assert ep["time"]["source"] == "fps" and ep["time"]["time"] == pytest.approx(np.arange(6) / FPS)


def test_stale_or_missing_stats_and_a_timestamp_field(tmp_path, capsys):
    """A timestamp step field is the time axis; statistics of another epoch are not aggregated, and
    a store without any says so; ``trajstore info`` says the same."""
    space = Dict({"timestamp": Box(0, np.inf, (), np.float64), "q": Box(-1, 1, (1,), np.float32)})
    path = str(tmp_path / "ts")
    with TrajectoryReplayBuffer.create(space, cache_path=path) as buf:
        for e in range(3):
            buf.extend({"timestamp": 0.5 + np.arange(4) ** 2 / 100.0, "q": np.zeros((4, 1), np.float32)})
            buf.mark_episode_end()
    with serving(path) as s:
        assert get_json(s, "/api/stats")[1] == {"stored": False, "episodes": 0, "of": 3, "fields": []}
        assert get_json(s, "/api/overview")[1]["robot"]["stats"] is None
        t = get_json(s, "/api/episode?id=2")[1]["time"]
    assert t == {"source": "timestamp", "time": pytest.approx(0.5 + np.arange(4) ** 2 / 100.0)}
    with TrajectoryReplayBuffer.load_from(path) as buf:
        buf.save_stats()
        buf.remove_episodes([1])  # a rewrite: a new epoch, the stored statistics are stale
    with serving(path) as s:
        stats = get_json(s, "/api/stats")[1]
    assert stats == {"stored": True, "episodes": 0, "of": 2, "fields": []}
    assert main(["info", path, "--json"]) == 0
    robot = json.loads(capsys.readouterr().out)["robot"]
    assert robot == {"fps": None, "tasks": 0, "episodes_with_task": 0,
                     "stats": {"episodes": 3, "fields": ["q", "timestamp"], "current": False}}
    assert main(["info", path]) == 0
    assert "robot          no fps, 0 task(s) (0 episode(s) with one), statistics of 3 episodes stored (stale" in \
        capsys.readouterr().out


def test_video_frames_are_served_through_the_buffers_read_path(tmp_path):
    path, recorded = video_store(tmp_path / "video")
    before = tree_hashes(path)
    with serving(path) as s:
        ep = get_json(s, "/api/episode?id=1")[1]
        assert {f["path"]: f["kind"] for f in ep["fields"]} == {"step_data/cam": "image", "step_data/action": "series"}
        frames = []
        for step in (5, 0, 7):  # out of order: each decodes from its keyframe
            status, body, ctype = get(s, f"/api/frame?id=1&field=step_data/cam&step={step}")
            assert status == 200 and ctype == "image/png"
            frames.append(imagecodecs.png_decode(body))
        assert get(s, "/api/frame?id=1&field=step_data/cam&step=8")[0] == 400
        ov = get_json(s, "/api/overview")[1]
    assert tree_hashes(path) == before
    assert next(a["codec"] for a in ov["arrays"] if a["path"] == "step_data/cam").startswith("video h264:crf=18:g=4")
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as buf:
        decoded = buf[[13, 8, 15]]["step_data"]["cam"]
    np.testing.assert_array_equal(np.stack(frames), decoded)  # the buffer's own decode, pixel for pixel
    err = np.abs(np.stack(frames).astype(np.int16) - recorded[[13, 8, 15]]).mean()
    assert err < 4  # and the recorded frames within the codec's loss


def test_an_icechunk_store_and_one_of_its_versions_are_served_read_only(tmp_path, monkeypatch, capsys):
    import trajstore
    from trajstore.cli.view import version_options
    from trajstore.errors import BadOptionError

    monkeypatch.chdir(tmp_path)
    url = "icechunk://repo"
    space = Dict({"obs": Box(-1, 1, (3,), np.float32), "reward": Box(-1, 1, (), np.float32)})
    buf = TrajectoryReplayBuffer.create(space, cache_path=url)
    for e in range(4):
        buf.extend({"obs": np.full((5, 3), e / 10, np.float32), "reward": np.ones(5, np.float32)})
        buf.mark_episode_end()
        if e == 1:
            buf.flush()
            trajstore.tag(url, "v1")
    buf.set_fps(5)
    buf.assign_task([0, 2], "reach")
    buf.close(save_stats=True)
    before = tree_hashes(tmp_path / "repo")
    with serving(url) as s:
        page = get_json(s, "/api/episodes?where=task%20%3D%3D%20'reach'")[1]
        assert page["total"] == 4 and [r[0] for r in page["rows"]] == [0, 2]
        assert get_json(s, "/api/stats")[1]["episodes"] == 4
        assert get_json(s, "/api/episode?id=3")[1]["series"]["step_data/obs"][0] == pytest.approx([0.3] * 5)
    with serving(url, storage_options=version_options(url, "v1", None)) as s:
        assert get_json(s, "/api/status")[1]["episodes"] == 2
        assert get_json(s, "/api/overview")[1]["tables"]["step_data"]["rows"] == 10
    assert tree_hashes(tmp_path / "repo") == before
    with pytest.raises(BadOptionError, match="has no versions"):
        version_options(str(tmp_path / "plain"), "v1", None)
    assert main(["view", url, "--version", "v9", "--port", "0"]) == 1  # refused before serving
    assert "v9" in capsys.readouterr().err
    assert tree_hashes(tmp_path / "repo") == before


def test_a_damaged_task_file_is_the_clis_error_on_the_page(tmp_path, capsys):
    path = image_store(tmp_path / "bad", episodes=2, length=3, robot=True)
    (tmp_path / "bad" / "trajstore.robot.json").write_text('{"version": 1, "fps": -3, "tasks": [], "episode_tasks": []}')
    assert main(["info", path]) == 1
    cli = capsys.readouterr().err.strip().split("error: ", 1)[1]
    assert "trajstore.robot.json fps is -3" in cli
    with serving(path) as s:
        for target in ("/api/overview", "/api/episodes", "/api/episode?id=0"):
            status, err = get_json(s, target)
            assert status == 422 and err["error"] == cli, target
        assert get_json(s, "/api/status")[0] == 200  # the server goes on
