"""``trajstore view`` over HTTP (issue 34): what it answers, what it refuses, and that it writes nothing.

Real stores on disk (a recorded CartPole replay store, a trajectory store of PNG-coded frames, a
zip copy, a sharded dataset, a damaged store), the real server on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import json
import os
import socket

import imagecodecs
import numpy as np
import pytest
from _view_stores import append_episode, frames_of, get, get_json, image_store, serving, tree_hashes
from gymnasium.spaces import Box

from trajstore import TrajectoryReplayBuffer
from trajstore.cli import main
from trajstore.demo import record_demo


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("view_http")
    return {"cartpole": record_demo(str(root / "cartpole"), episodes=4),
            "images": image_store(root / "images", robot=True)}


def test_a_session_of_requests_reads_and_never_writes(stores):
    """Every endpoint, good and bad requests, on both stores: the stores' files are the same bytes after."""
    before = {k: tree_hashes(p) for k, p in stores.items()}
    for name, path in stores.items():
        with serving(path) as s:
            for target in ["/", "/static/app.js", "/static/uPlot.iife.min.js", "/api/parts", "/api/status",
                           "/api/overview", "/api/stats", "/api/episodes?sort=return&desc=1", "/api/episodes?where=length%3E3",
                           "/api/episode?id=1", "/api/episode?id=999", "/api/frame?id=0&field=step_data/cam&step=2",
                           "/api/frame?id=0&field=step_data/grey&step=1&fmt=jpeg&size=8"]:
                status, body, _ = get(s, target)
                assert status < 500, (target, body)
    assert {k: tree_hashes(p) for k, p in stores.items()} == before


def test_overview_and_episode_table_match_the_cli(stores, capsys):
    with serving(stores["cartpole"]) as s:
        status, ov = get_json(s, "/api/overview")
        assert status == 200 and ov["kind"] == "ReplayBuffer" and ov["tables"]["step_data"]["rows"] > 0
        assert {a["path"] for a in ov["arrays"]} >= {"step_data/obs", "step_data/reward"}
        status, page = get_json(s, "/api/episodes?sort=return&desc=1&limit=2")
    assert main(["episodes", stores["cartpole"], "--sort", "return", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert page["total"] == cli["episodes_total"] == 4 and page["matched"] == 4
    ids = [r[page["columns"].index("episode_id")] for r in page["rows"]]
    assert ids == [e["id"] for e in cli["episodes"][:2]]
    with serving(stores["cartpole"]) as s:
        pages = [get_json(s, f"/api/episodes?sort=return&desc=1&offset={o}&limit=3")[1] for o in (0, 3, 6)]
    assert [len(p["rows"]) for p in pages] == [3, 1, 0]
    assert [r[0] for p in pages for r in p["rows"]] == [e["id"] for e in cli["episodes"]]


def test_filter_uses_the_where_language_over_episode_data(stores):
    with serving(stores["images"]) as s:
        status, page = get_json(s, "/api/episodes?where=goal%20%3D%3D%201%20or%20success%20%3E%200.5")
        assert status == 200 and page["matched"] == 1
        assert page["rows"][0][page["columns"].index("episode_id")] == 1
        status, err = get_json(s, "/api/episodes?where=__import__('os')")
        assert status == 400 and "allowed: numbers" in err["error"]
        status, err = get_json(s, "/api/episodes?where=nope%20%3E%201")
        assert status == 404 and "no episode field 'nope'" in err["error"] and "goal" in err["error"]
        status, err = get_json(s, "/api/episodes?sort=nope")
        assert status == 400 and "no column 'nope'" in err["error"]


def test_episode_series_and_frames_are_the_stored_values(stores):
    with serving(stores["images"]) as s:
        status, ep = get_json(s, "/api/episode?id=2")
        assert status == 200 and ep["length"] == 12
        kinds = {f["path"]: f["kind"] for f in ep["fields"]}
        assert kinds == {"step_data/cam": "image", "step_data/grey": "image", "step_data/action": "series",
                         "step_data/reward": "series"}
        np.testing.assert_allclose(ep["series"]["step_data/reward"][0], np.full(12, 0.3, np.float32))
        status, body, ctype = get(s, "/api/frame?id=2&field=step_data/cam&step=7")
        assert status == 200 and ctype == "image/png"
        np.testing.assert_array_equal(imagecodecs.png_decode(body), frames_of(2, 12)[7])
        status, body, ctype = get(s, "/api/frame?id=2&field=step_data/cam&step=7&fmt=jpeg&size=16")
        assert status == 200 and ctype == "image/jpeg" and imagecodecs.jpeg8_decode(body).shape == (12, 16, 3)


@pytest.mark.parametrize("target,code,words", [
    ("/api/episode?id=77", 404, "episode 77 has no steps"),
    ("/api/episode?id=abc", 400, "id must be an integer"),
    ("/api/episode", 400, "missing parameter 'id'"),
    ("/api/frame?id=0&field=step_data/action&step=0", 404, "no image field 'step_data/action'"),
    ("/api/frame?id=0&field=../../etc/passwd&step=0", 404, "no image field"),
    ("/api/frame?id=0&field=step_data/cam&step=12", 400, "step 12 is outside episode 0 (steps 0..11)"),
    ("/api/frame?id=0&field=step_data/cam&step=-1", 400, "step must be 0.."),
    ("/api/frame?id=0&field=step_data/cam&step=0&fmt=bmp", 400, "fmt must be one of"),
    ("/api/frame?id=0&field=step_data/cam&step=0&size=100000", 400, "size must be"),
    ("/api/episodes?limit=100000", 400, "limit must be 1..500"),
    ("/api/status?part=1", 400, "part must be 0..0"),
    ("/api/status?file=/etc/passwd", 400, "unknown parameter(s) ['file']"),
    ("/api/status?part=0&part=0", 400, "at most once"),
    ("/static/../../../etc/passwd", 404, "never a file path"),
    ("/etc/passwd", 404, "never a file path"),
    ("/api/" + "x" * 9000, 414, "at most 8192"),
])
def test_bad_requests_are_4xx_with_a_message(stores, target, code, words):
    with serving(stores["images"]) as s:
        status, body, ctype = get(s, target)
        assert status == code and ctype == "application/json", body
        assert words in json.loads(body)["error"]
        assert get(s, "/api/status")[0] == 200  # and the server goes on


def test_other_methods_and_foreign_hosts_are_refused(stores):
    with serving(stores["images"]) as s:
        host, port = s.server_address[:2]
        for method in ("POST", "PUT", "DELETE"):
            with socket.create_connection((host, port), timeout=10) as c:
                c.sendall(f"{method} /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello".encode())
                assert c.recv(200).startswith(b"HTTP/1.1 405"), method
        status, body, _ = get(s, "/api/status", headers={"Host": "evil.example:80"})
        assert status == 421 and b"not this server" in body
        assert s.server_address[0] == "127.0.0.1"


def test_a_damaged_store_gives_the_clis_message_and_the_server_goes_on(tmp_path, capsys):
    path = image_store(tmp_path / "bad", episodes=2, length=6)
    (tmp_path / "bad" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {"trajstore": 7}}')
    assert main(["info", path]) == 1
    cli = capsys.readouterr().err.strip().split("error: ", 1)[1]
    with serving(path) as s:
        for target in ("/api/overview", "/api/status", "/api/episodes"):
            status, err = get_json(s, target)
            assert status == 422 and err["error"] == cli, target
        assert get(s, "/")[0] == 200


def test_a_damaged_frame_is_a_4xx_and_other_frames_still_load(tmp_path):
    path = image_store(tmp_path / "chunks", episodes=2, length=6)
    chunks = sorted((tmp_path / "chunks" / "step_data" / "cam" / "c").rglob("*"))
    victim = [c for c in chunks if c.is_file()][0]
    victim.write_bytes(b"\x89PNG garbage" * 10)
    with serving(path) as s:
        status, err = get_json(s, "/api/frame?id=0&field=step_data/cam&step=0")
        assert status == 422 and err["error"], err
        assert get(s, "/api/episode?id=1")[0] == 200


def test_zip_copies_and_sharded_datasets_are_served(stores, tmp_path, capsys):
    zpath = str(tmp_path / "images.zip")
    assert main(["copy", stores["images"], zpath]) == 0
    with serving(zpath) as s:
        status, body, _ = get(s, "/api/frame?id=1&field=step_data/cam&step=3")
        assert status == 200
        np.testing.assert_array_equal(imagecodecs.png_decode(body), frames_of(1, 12)[3])
    from trajstore import create_shard

    root = str(tmp_path / "sharded")
    for k in range(2):
        with create_shard(root, Box(-1, 1, (3,), np.float32), shard=f"s{k}") as w:
            for _e in range(k + 1):
                w.extend(np.zeros((5, 3), np.float32))
                w.mark_episode_end()
    with serving(root) as s:
        status, parts = get_json(s, "/api/parts")
        assert status == 200 and parts["folder"]["layout"] == "sharded"
        assert [p["name"] for p in parts["parts"]] == ["shards/s0", "shards/s1"]
        assert [get_json(s, f"/api/status?part={i}")[1]["episodes"] for i in range(2)] == [1, 2]


def test_status_follows_a_writer_and_a_rings_evictions(tmp_path):
    path = image_store(tmp_path / "ring", episodes=3, length=4, capacity=12)
    with serving(path) as s:
        assert get_json(s, "/api/status")[1]["episodes"] == 3
        gen = get_json(s, "/api/status")[1]["generation"]
        buf = TrajectoryReplayBuffer.load_from(path)
        try:
            append_episode(buf, 3, 4)
        finally:
            buf.close()
        status, st = get_json(s, "/api/status")
        assert st["generation"] > gen and st["episodes"] == 3
        page = get_json(s, "/api/episodes")[1]
        assert [r[0] for r in page["rows"]] == [1, 2, 3]
        status, err = get_json(s, "/api/frame?id=0&field=step_data/cam&step=0")
        assert status == 404 and "episode 0 has no steps" in err["error"]
    assert os.path.isdir(path)


def test_bench_view_quick(tmp_path):
    """scripts/bench_view.py runs (timings printed, never asserted) and returns its markdown section."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_view.py"
    md = tmp_path / "view.md"
    out = subprocess.run([sys.executable, str(script), "--quick", "--dir", str(tmp_path), "--markdown", str(md)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    text = md.read_text()
    assert text.startswith("## trajstore view") and "thumbnails of random steps, 4 connections" in text


def test_the_view_command_serves_until_stopped(stores):
    """`python -m trajstore view PATH --port 0` prints its address, answers there, and stops on SIGINT."""
    import signal
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "trajstore", "view", stores["cartpole"], "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "read-only at http://127.0.0.1:" in line, line + proc.stderr.read()
        url = line.split(" at ", 1)[1].split()[0]
        with urllib.request.urlopen(url + "api/status", timeout=30) as r:
            assert json.loads(r.read())["episodes"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 130


def test_a_remote_store_is_served(tmp_path):
    """An fsspec URL (memory://, in this process) is opened as the CLI opens it."""
    url = f"memory://view-{os.getpid()}-{tmp_path.name}/cp"
    record_demo(url, episodes=2)
    with serving(url) as s:
        status, page = get_json(s, "/api/episodes")
        assert status == 200 and page["total"] == 2
        assert get_json(s, "/api/overview")[1]["path"] == url


def test_frames_read_while_a_writer_turns_the_ring_are_the_episodes_own(tmp_path):
    """A frame answered while a writer evicts and refills ring slots is the asked episode's frame (never
    another episode's, nor a slot's new contents), or a 404."""
    import threading

    path = image_store(tmp_path / "turning", episodes=3, length=6, capacity=18)
    stop = threading.Event()

    def write() -> None:
        buf = TrajectoryReplayBuffer.load_from(path)
        try:
            e = 3
            while not stop.is_set() and e < 200:
                append_episode(buf, e, 6)
                e += 1
        finally:
            buf.close()

    writer = threading.Thread(target=write)
    rng = np.random.default_rng(0)
    answered = 0
    with serving(path) as s:
        writer.start()
        try:
            for _ in range(80):
                status, page = get_json(s, "/api/episodes")
                if status == 503:  # the ring turned under the table's read three times: ask again
                    continue
                ids = [r[0] for r in page["rows"]]
                assert ids == sorted(ids) and len(ids) <= 4, ids  # 3 episodes, a 4th being evicted
                eid, step = int(rng.choice(ids)), int(rng.integers(0, 6))
                status, body, _ = get(s, f"/api/frame?id={eid}&field=step_data/cam&step={step}")
                if status in (404, 503) or (status == 400 and b"is outside episode" in body):  # evicted meanwhile
                    continue
                assert status == 200, body
                # A ring keeps the last steps of an episode it is evicting: step 0 is then a later one.
                frame, own = imagecodecs.png_decode(body), frames_of(eid, 6)
                assert any(np.array_equal(frame, own[k]) for k in range(step, 6)), (eid, step)
                answered += 1
        finally:
            stop.set()
            writer.join(60)
    assert answered > 0


def test_a_stable_baselines3_buffer_folder_lists_its_stores(tmp_path):
    """A buffer's cache_path (sb3.json and its stores inside, as trajstore.sb3 lays it out) is served
    store by store, its problems named; the folder is recognised from its record alone."""
    folder = tmp_path / "sac_buffer"
    image_store(folder / "transitions", episodes=2, length=5)
    (folder / "sb3.json").write_text(json.dumps({"trajstore_sb3": 1, "kind": "ZarrRolloutBuffer"}))
    with serving(folder) as s:
        status, parts = get_json(s, "/api/parts")
        assert status == 200 and parts["folder"]["layout"] == "sb3"
        assert [p["name"] for p in parts["parts"]] == ["transitions"]
        assert parts["folder"]["problems"] == ["store 'rollout' is missing: the ZarrRolloutBuffer cannot be reopened"]
        assert get_json(s, "/api/status?part=0")[1]["episodes"] == 2


def test_the_view_command_refuses_a_path_with_no_store(tmp_path, capsys):
    assert main(["view", str(tmp_path / "nothing"), "--port", "0"]) == 1
    assert "no store at" in capsys.readouterr().err
    (tmp_path / "folder" / "x").mkdir(parents=True)
    assert main(["view", str(tmp_path / "folder"), "--port", "0"]) == 1
    assert "not a trajstore store" in capsys.readouterr().err
