"""What the CLI and ``dumps`` report and write for sharing, on real stores.

- A ``.zip`` meant for sharing is small: raw arrays are compressed (lz4 row blocks), only chunks
  holding committed rows are written (unbounded arrays sized to the rows; a ring keeps its
  capacity, its unwritten chunks absent), plain zarr reads every array and equals the source, and
  ``--compressor none`` / ``dumps(..., compressor="none")`` keeps raw chunks.
- Numbers mean what a user means: step rows and episodes apart, finished episodes (+1 in
  progress), a compression ratio only for compressed arrays ("raw" otherwise).
- ``demo`` takes ``--json`` and says ``--overwrite``; a non-zip file named ``.zip`` is a
  ``NotATrajstoreError`` naming the path.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import zarr
from zarr.storage import ZipStore

from trajstore import ReplayBuffer, TrajectoryReplayBuffer, errors
from trajstore.cli import main
from trajstore.demo import record_demo

VEC = gym.spaces.Dict({
    "obs": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
    "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float32),
    "terminated": gym.spaces.MultiBinary(1),
})


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_json(capsys, *args: str) -> dict:
    code, out, err = cli(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def _json_bytes(folder: Path) -> int:
    """Bytes of a folder store's metadata files (zarr.json, the commit record...)."""
    return sum(p.stat().st_size for p in folder.rglob("*.json"))


def _plain_zarr_equal(src: Path, zip_path: Path, paths: list[str], rows: int) -> None:
    """Every array of the zip, read by zarr alone, equals the source's committed rows."""
    zs = ZipStore(zip_path, mode="r")
    try:
        for p in paths:
            a = zarr.open_array(str(src), path=p, mode="r")
            b = zarr.open_array(zs, path=p, mode="r")
            assert b.shape[0] == rows, (p, b.shape)
            np.testing.assert_array_equal(b[:], a[:rows])
    finally:
        zs.close()


def _chunk_members(zip_path: Path, array: str) -> set[int]:
    with zipfile.ZipFile(zip_path) as zf:
        return {int(n[len(array) + 3:].split("/")[0]) for n in zf.namelist() if n.startswith(f"{array}/c/")}


# -- Task: a .zip meant for sharing is small --------------------------------------------------------------------
def test_zip_of_the_demo_store_is_small_and_zarr_reads_it(tmp_path: Path, capsys) -> None:
    src = tmp_path / "demo"
    record_demo(src, episodes=5)
    info = cli_json(capsys, "info", str(src))
    paths = [a["path"] for a in info["arrays"]]
    rows = info["tables"]["step_data"]["rows"]
    folder_bytes = info["stored_bytes"]
    for how, z in (("copy", tmp_path / "c.zip"), ("dumps", tmp_path / "d.zip")):
        if how == "copy":
            out = cli_json(capsys, "copy", str(src), str(z))
            assert out["method"] == "zip" and out["bytes"] == z.stat().st_size and out["rows"] == rows
        else:
            with ReplayBuffer.load_from(src, read_only=True) as rb:
                rb.dumps(z)
        size = z.stat().st_size
        # Smaller than the committed data plus the source's metadata (it was 6 MiB: 1,500x that).
        assert size < info["logical_bytes"] + _json_bytes(src), (size, info["logical_bytes"], _json_bytes(src))
        assert size < folder_bytes  # (the folder itself is small now: chunk files grow with their rows)
        _plain_zarr_equal(src, z, paths, rows)
        zi = cli_json(capsys, "info", str(z))
        assert {a["codec"] for a in zi["arrays"]} == {"blosc:lz4"} and zi["stored_bytes"] == size
        assert zi["episodes"]["finished"] == 5
        with ReplayBuffer.load_from(src, read_only=True) as a, ReplayBuffer.load_from(z, read_only=True) as b:
            for k, v in a[:].items():
                np.testing.assert_array_equal(b[:][k], v)
            assert set(b.sample(256, rng=0)) == set(a[0])
        code, text, _ = cli(capsys, "verify", str(z), "--deep")
        assert code == 0 and f"{rows} step rows" in text

    # Raw on request: no codec, still only the committed rows' chunks.
    raw = tmp_path / "raw.zip"
    cli_json(capsys, "copy", str(src), str(raw), "--compressor", "none")
    zi = cli_json(capsys, "info", str(raw))
    assert {a["codec"] for a in zi["arrays"]} == {"none"} and zi["compression_ratio"] is None
    assert raw.stat().st_size < 64 << 10
    _plain_zarr_equal(src, raw, paths, rows)
    with ReplayBuffer.load_from(src, read_only=True) as rb:
        rb.dumps(tmp_path / "raw2.zip", compressor="none")
        rb.dumps(tmp_path / "z.zip", compressor="zstd")
        with pytest.raises(ValueError, match="trajstore copy"):
            rb.dumps(tmp_path / "folder", compressor="lz4")  # a folder copy keeps the layout
    assert {a["codec"] for a in cli_json(capsys, "info", str(tmp_path / "raw2.zip"))["arrays"]} == {"none"}
    assert {a["codec"] for a in cli_json(capsys, "info", str(tmp_path / "z.zip"))["arrays"]} == {"blosc:zstd"}


def test_zip_of_a_ring_keeps_its_capacity_and_only_written_chunks(tmp_path: Path, capsys) -> None:
    cap, C = 10_000, 1024
    rng = np.random.default_rng(0)

    def rows(n: int, start: int) -> dict[str, np.ndarray]:
        return {"obs": rng.random((n, 4), dtype=np.float32), "reward": np.arange(start, start + n, dtype=np.float32),
                "terminated": (np.arange(start, start + n) % 100 == 99).astype(np.int8)[:, None]}

    # A ring that wrapped (its chunks all hold rows) and one a third full (chunks 0-2 only).
    for name, n in (("wrapped", 13_000), ("third", 3_000)):
        src = tmp_path / name
        with ReplayBuffer.create(VEC, cache_path=src, capacity=cap, chunk_rows=C) as rb:
            rb.extend(rows(n, 0))
            offset = rb.offset
        z = tmp_path / f"{name}.zip"
        out = cli_json(capsys, "copy", str(src), str(z), "--compressor", "lz4", "--chunk-rows", str(C))
        assert out["rows"] == min(n, cap)
        with ReplayBuffer.load_from(src, read_only=True) as a, ReplayBuffer.load_from(z, read_only=True) as b:
            assert (len(b), b.capacity, b.offset) == (len(a), cap, offset)
            np.testing.assert_array_equal(b[:]["reward"], a[:]["reward"])
        want = set(range(-(-cap // C))) if n >= cap else set(range(-(-n // C)))
        assert _chunk_members(z, "step_data/obs") == want
        zs = ZipStore(z, mode="r")
        try:
            arr = zarr.open_array(zs, path="step_data/reward", mode="r")
            assert arr.shape == (cap,)
            if n < cap:
                assert not arr[n:].any()  # absent chunks read as the fill value
        finally:
            zs.close()
        assert cli(capsys, "verify", str(z), "--deep")[0] == 0


def test_trajectory_zip_round_trips_and_grows_again_in_a_folder(tmp_path: Path, capsys) -> None:
    src, z, back = tmp_path / "t", tmp_path / "t.zip", tmp_path / "back"
    sp = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32)})
    with TrajectoryReplayBuffer.create(sp, cache_path=src, episode_data_instance_space=gym.spaces.Box(-1e9, 1e9, (), np.float64)) as tb:
        for e in range(30):
            tb.extend({"obs": np.full((20, 3), e / 30, np.float32)})
            tb.set_current_episode_data(np.float64(e))
            tb.mark_episode_end()
        tb.dumps(z)
        want, eps, cur = tb[:], tb.episodes(), tb.current_episode_id
    with TrajectoryReplayBuffer.load_from(z, read_only=True) as r:
        np.testing.assert_array_equal(r[:]["step_data"]["obs"], want["step_data"]["obs"])
        np.testing.assert_array_equal(r[:]["episode_data"], want["episode_data"])
        for k, v in r.episodes().items():
            np.testing.assert_array_equal(v, eps[k])
        assert r.current_episode_id == cur
    # A zip's arrays are sized to the rows; copied back into a folder, the store grows again.
    assert cli(capsys, "copy", str(z), str(back))[0] == 0
    with TrajectoryReplayBuffer.load_from(back) as tb:
        tb.extend({"obs": np.zeros((5000, 3), np.float32)})
        tb.mark_episode_end()
        assert len(tb) == 600 + 5000
    assert cli(capsys, "verify", str(back), "--deep")[0] == 0


def test_a_file_named_zip_that_is_no_zip_names_the_path(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "notes.zip"
    bad.write_text("just text\n")
    for open_it in (lambda: ReplayBuffer.load_from(bad, read_only=True), lambda: ReplayBuffer.load_from(bad)):
        with pytest.raises(errors.NotATrajstoreError) as ei:
            open_it()
        assert str(bad) in str(ei.value) and "no zip archive" in str(ei.value)
    code, _out, err = cli(capsys, "info", str(bad))
    assert code == 1 and str(bad) in err and "no zip archive" in err and err.count("\n") == 1
    assert bad.read_text() == "just text\n"
    # An existing folder named *.zip is a folder store.
    (tmp_path / "f.zip").mkdir()
    with ReplayBuffer.create(VEC, cache_path=tmp_path / "f.zip") as rb:
        rb.append({"obs": np.zeros(4, np.float32), "reward": np.float32(1), "terminated": np.array([1], np.int8)})
    with ReplayBuffer.load_from(tmp_path / "f.zip", read_only=True) as ro:
        assert len(ro) == 1


def test_a_failed_zip_copy_leaves_nothing_at_the_target(tmp_path: Path, monkeypatch) -> None:
    import trajstore.storage.location

    with ReplayBuffer.create(VEC, cache_path=tmp_path / "s", chunk_rows=256) as rb:
        rb.extend({"obs": np.ones((5000, 4), np.float32), "reward": np.ones(5000, np.float32),
                   "terminated": np.zeros((5000, 1), np.int8)})
        real, calls = trajstore.storage.location.Location.put, {"n": 0}

        def put(self, key, data, **kw):
            if "/c/" in key:
                calls["n"] += 1
                if calls["n"] == 2:  # the second chunk: metadata and a chunk were written
                    raise OSError(28, "No space left on device")
            return real(self, key, data, **kw)

        monkeypatch.setattr(trajstore.storage.location.Location, "put", put)
        with pytest.raises(OSError):
            rb.dumps(tmp_path / "s.zip")
        assert calls["n"] == 2
        monkeypatch.setattr(trajstore.storage.location.Location, "put", real)
    import gc

    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # no zip, no temp file


# -- Task: report what a user means by each number ----------------------------------------------------------------
def test_a_store_of_100_finished_episodes_says_100(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t"
    sp = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32)})
    with TrajectoryReplayBuffer.create(sp, cache_path=path) as tb:
        for e in range(100):
            tb.extend({"obs": np.zeros((7, 3), np.float32)})
            tb.mark_episode_end()
    info = cli_json(capsys, "info", str(path))
    eps = info["episodes"]
    assert (eps["finished"], eps["in_progress"], eps["present"], eps["finished_total"]) == (100, 0, 100, 100)
    text = cli(capsys, "info", str(path))[1]
    assert "episodes       100 finished," in text and "101" not in text.split("episodes", 1)[1].split("\n")[0]
    assert "raw (uncompressed" in text and "0.0" not in text.split("size on disk", 1)[1].split("\n")[0]
    assert info["compression_ratio"] is None and info["raw_arrays"] == len(info["arrays"])
    ls = cli(capsys, "ls", str(path))[1]
    assert all(line.rstrip().endswith("raw") for line in ls.splitlines()[1:])
    # One more episode with steps, not ended: +1 in progress.
    with TrajectoryReplayBuffer.load_from(path) as tb:
        tb.extend({"obs": np.zeros((3, 3), np.float32)})
    eps = cli_json(capsys, "info", str(path))["episodes"]
    assert (eps["finished"], eps["in_progress"]) == (100, 1)
    assert "100 finished (+1 in progress)" in cli(capsys, "info", str(path))[1]


def test_ring_of_a_trajectory_store_says_how_many_were_evicted(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t"
    sp = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32)})
    with TrajectoryReplayBuffer.create(sp, cache_path=path, step_data_capacity=100) as tb:
        for e in range(30):
            tb.extend({"obs": np.zeros((10, 3), np.float32)})
            tb.mark_episode_end()
    eps = cli_json(capsys, "info", str(path))["episodes"]
    assert eps["finished"] == 10 and eps["finished_total"] == 30
    assert "10 finished, 30 since the store was created (20 evicted from the ring)" in cli(capsys, "info", str(path))[1]


def test_compression_ratio_is_data_over_stored_bytes_of_compressed_arrays(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c"
    with ReplayBuffer.create(VEC, cache_path=path, compressor="lz4") as rb:
        rb.extend({"obs": np.zeros((4000, 4), np.float32), "reward": np.ones(4000, np.float32),
                   "terminated": np.zeros((4000, 1), np.int8)})
    info = cli_json(capsys, "info", str(path))
    stored = sum(a["stored_bytes"] for a in info["arrays"])
    assert info["compression_ratio"] == pytest.approx(info["logical_bytes"] / stored) and info["compression_ratio"] > 2
    assert info["raw_arrays"] == 0 and info["compressed_arrays"] == 3
    assert f"compression ratio {info['compression_ratio']:.2f}x" in cli(capsys, "info", str(path))[1]


def test_verify_and_copy_report_steps_and_episodes_apart(tmp_path: Path, capsys) -> None:
    path = tmp_path / "t"
    sp = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32)})
    with TrajectoryReplayBuffer.create(sp, cache_path=path, episode_data_instance_space=gym.spaces.Box(0, 9, (), np.float32)) as tb:
        for e in range(4):
            tb.extend({"obs": np.zeros((25, 3), np.float32)})
            tb.set_current_episode_data(np.float32(e))
            tb.mark_episode_end()
        tb.extend({"obs": np.zeros((5, 3), np.float32)})
    code, text, _ = cli(capsys, "verify", str(path))
    assert code == 0 and "105 step rows, 4 episode-data rows" in text and "committed rows" not in text
    rep = cli_json(capsys, "verify", str(path))
    assert rep["checked"]["table_rows"] == {"step_data": 105, "episode_data": 4}
    code, text, _ = cli(capsys, "copy", str(path), str(tmp_path / "c.zip"))
    assert code == 0 and "copied 105 steps, 4 finished episodes (+1 in progress), 4 episode-data rows" in text
    out = cli_json(capsys, "copy", str(path), str(tmp_path / "d"))
    assert out["rows"] == 105 and out["episodes"]["finished"] == 4 and out["episodes"]["in_progress"] == 1


def test_demo_takes_json_and_says_overwrite(tmp_path: Path, capsys) -> None:
    d = tmp_path / "demo"
    info = cli_json(capsys, "demo", str(d), "--episodes", "2")
    assert info["kind"] == "ReplayBuffer" and info["episodes"]["finished"] == 2
    assert info["tables"]["step_data"]["rows"] == len(ReplayBuffer.load_from(d, read_only=True))
    code, out, err = cli(capsys, "demo", str(d), "--episodes", "2")
    assert code == 1 and "--overwrite" in err and "overwrite=True" not in err and str(d) in err
    code, out, err = cli(capsys, "demo", str(d), "--episodes", "3", "--overwrite")
    assert code == 0 and "recorded 3 episodes" in out and "3 finished" in out
    os.remove(d / "trajstore.head.json")  # what is there no longer is a store: still refused
    code, out, err = cli(capsys, "demo", str(d))
    assert code == 1 and "--overwrite" in err
