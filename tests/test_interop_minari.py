"""Minari import and export (issue 14): datasets written by minari's own
``create_dataset_from_buffers`` (hdf5), found by id under MINARI_DATASETS_PATH or by folder; T+1
observations split into obs / next_obs and rebuilt exactly; spaces, seeds and metadata kept;
``minari.load_dataset`` iterates an exported store's episodes; bad input refused before writing."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

minari = pytest.importorskip("minari")

from minari.data_collector.episode_buffer import EpisodeBuffer  # noqa: E402

from trajstore import TrajectoryReplayBuffer  # noqa: E402
from trajstore.cli import main  # noqa: E402
from trajstore.errors import (  # noqa: E402
    BadArgumentError,
    BadOptionError,
    DamagedStoreError,
    NotATrajstoreError,
    StoreExistsError,
    StoreNotFoundError,
    UnknownFieldError,
)
from trajstore.interop import export_minari, import_minari  # noqa: E402
from trajstore.maintenance.verify import verify_store  # noqa: E402
from trajstore.metadata import get_dataset_info  # noqa: E402

OBS = gym.spaces.Dict({"pos": gym.spaces.Box(-5, 5, (3,), np.float32), "goal": gym.spaces.Discrete(4)})
ACT = gym.spaces.Box(-1, 1, (2,), np.float32)


@pytest.fixture(autouse=True)
def datasets_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "minari_datasets"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    warnings.filterwarnings("ignore", module="minari")
    return root


def make_dataset(dataset_id: str = "toy/reach-v0", lengths: tuple[int, ...] = (7, 12, 1, 30),
                 seed: int = 0, data_format: str = "hdf5") -> list[dict[str, Any]]:
    """A Dict-obs dataset written by minari (in ``data_format``) with infos, scalar and nested;
    returns the episodes as written."""
    rng = np.random.default_rng(seed)
    episodes, buffers = [], []
    for k, t in enumerate(lengths):
        ep = {"observations": {"pos": rng.uniform(-5, 5, (t + 1, 3)).astype(np.float32),
                               "goal": rng.integers(0, 4, t + 1)},
              "actions": rng.uniform(-1, 1, (t, 2)).astype(np.float32), "rewards": rng.standard_normal(t),
              "terminations": np.arange(t) == t - 1 if k % 2 == 0 else np.zeros(t, bool),
              "truncations": np.zeros(t, bool) if k % 2 == 0 else np.arange(t) == t - 1,
              "infos": {"success": (np.arange(t + 1) == t), "dist": {"l2": rng.random(t + 1)}}}
        episodes.append(ep)
        buffers.append(EpisodeBuffer(id=k, seed=100 + k if k != 2 else None, **ep))
    minari.create_dataset_from_buffers(dataset_id, buffers, observation_space=OBS, action_space=ACT,
                                       algorithm_name="random-policy", author="Ada", author_email="ada@example.org",
                                       code_permalink="https://example.org/code", description="a toy",
                                       data_format=data_format)
    return episodes


@pytest.mark.parametrize("data_format", ["hdf5", "arrow"])
def test_import_by_id_values_spaces_seeds_metadata(tmp_path: Path, data_format: str) -> None:
    episodes = make_dataset(data_format=data_format)
    with import_minari("toy/reach-v0", tmp_path / "s") as buf:
        assert buf.step_space["obs"] == OBS and buf.step_space["action"] == ACT
        table = buf.episodes()
        assert table["length"].tolist() == [7, 12, 1, 30]
        for eid, ep in zip(table["episode_id"].tolist(), episodes):
            got: Any = buf.get_episode(eid)
            sd, ed = got["step_data"], got["episode_data"]
            for key in ("pos", "goal"):
                np.testing.assert_array_equal(sd["obs"][key], ep["observations"][key][:-1])
                np.testing.assert_array_equal(sd["next_obs"][key], ep["observations"][key][1:])
            np.testing.assert_array_equal(sd["action"], ep["actions"])
            np.testing.assert_array_equal(sd["reward"], ep["rewards"])
            np.testing.assert_array_equal(sd["terminated"], ep["terminations"])
            np.testing.assert_array_equal(sd["truncated"], ep["truncations"])
            np.testing.assert_array_equal(sd["info"]["success"], ep["infos"]["success"][1:])
            np.testing.assert_array_equal(sd["info"]["dist"]["l2"], ep["infos"]["dist"]["l2"][1:])
            assert int(ed["minari_id"][0]) == eid
            assert int(ed["seed"][0]) == (100 + eid if eid != 2 else -1)
            np.testing.assert_allclose(ed["return"][0], ep["rewards"].sum())
        meta = get_dataset_info(buf)["imported_from"]["metadata"]
        assert meta["algorithm_name"] == "random-policy" and meta["author"] == ["Ada"]
        assert meta["dataset_id"] == "toy/reach-v0"
    assert verify_store(tmp_path / "s").ok


@pytest.mark.parametrize("src_format, dst_format", [("hdf5", "hdf5"), ("arrow", "arrow"), ("hdf5", "arrow")])
def test_round_trip_minari_store_minari(tmp_path: Path, datasets_root: Path, src_format: str, dst_format: str) -> None:
    episodes = make_dataset(seed=3, data_format=src_format)
    import_minari(datasets_root / "toy" / "reach-v0", tmp_path / "s").close()  # by folder this time
    folder = export_minari(tmp_path / "s", "toy/reach-again-v0", description="exported", data_format=dst_format)
    assert folder == str(datasets_root / "toy" / "reach-again-v0")
    a, b = minari.load_dataset("toy/reach-v0"), minari.load_dataset("toy/reach-again-v0")
    assert b.storage.FORMAT == dst_format and a.storage.FORMAT == src_format
    assert (b.total_episodes, b.total_steps) == (a.total_episodes, a.total_steps)
    assert b.observation_space == a.observation_space and b.action_space == a.action_space
    # Compared with the episodes as written: minari 0.5.4's own arrow reader cannot read the
    # source's infos (trajstore's import reads them; the export writes none, so minari reads it).
    for ea, eb in zip(episodes, b.iterate_episodes(), strict=True):
        for key in ("pos", "goal"):  # T+1 observations rebuilt exactly
            np.testing.assert_array_equal(eb.observations[key], ea["observations"][key])
        for f in ("actions", "rewards", "terminations", "truncations"):
            np.testing.assert_array_equal(getattr(eb, f), ea[f], err_msg=f)
    seeds = [m.get("seed") for m in b.storage.get_episode_metadata(range(4))]
    assert seeds == [m.get("seed") for m in a.storage.get_episode_metadata(range(4))] == [100, 101, None, 103]
    meta = b.storage.metadata
    assert meta["algorithm_name"] == "random-policy" and meta["description"] == "exported"
    assert set(meta["author"]) == {"Ada"}


def test_export_recorded_store_to_datasets_path(tmp_path: Path) -> None:
    from trajstore.recording import RecordEpisodes

    env = RecordEpisodes(gym.make("CartPole-v1"), cache_path=str(tmp_path / "rec"), record_next_obs=True)
    for k in range(3):
        env.reset(seed=k)
        done = False
        while not done:
            _, _, te, tr, _ = env.step(env.action_space.sample())
            done = te or tr
    env.close()
    with TrajectoryReplayBuffer.load_from(tmp_path / "rec", read_only=True) as rec:
        lengths = rec.episodes()["length"].tolist()
    folder = export_minari(tmp_path / "rec", "cartpole/recorded-v1", datasets_path=tmp_path / "elsewhere",
                           algorithm_name="random")
    assert folder == str(tmp_path / "elsewhere" / "cartpole" / "recorded-v1")
    os.environ["MINARI_DATASETS_PATH"] = str(tmp_path / "elsewhere")  # the fixture restores it
    ds = minari.load_dataset("cartpole/recorded-v1")
    assert [len(e.rewards) for e in ds.iterate_episodes()] == lengths
    assert [m["seed"] for m in ds.storage.get_episode_metadata(range(3))] == [0, 1, 2]


def test_refusals_before_writing(tmp_path: Path, datasets_root: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="no local Minari dataset 'toy/none-v0'.*MINARI_DATASETS_PATH"):
        import_minari("toy/none-v0", tmp_path / "s")
    (tmp_path / "notminari").mkdir()
    with pytest.raises(NotATrajstoreError, match="not a Minari dataset folder"):
        import_minari(tmp_path / "notminari", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    from trajstore.recording import EPISODE_SPACE, step_space

    with TrajectoryReplayBuffer.create(step_space(gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(2)),
                                       episode_data_instance_space=EPISODE_SPACE, cache_path=tmp_path / "nonext") as b:
        b.extend({"obs": np.zeros((3, 2), np.float32), "action": np.zeros(3, np.int64), "reward": np.zeros(3),
                  "terminated": np.zeros(3, bool), "truncated": np.zeros(3, bool)})
    with pytest.raises(UnknownFieldError, match="no next_obs; Minari keeps T\\+1 observations"):
        export_minari(tmp_path / "nonext", "toy/x-v0")
    with pytest.raises(BadArgumentError, match="namespace/name-v0"):
        export_minari(tmp_path / "nonext", "../escape")
    with pytest.raises(BadOptionError, match="data_format must be one of \\('hdf5', 'arrow'\\); got 'zarr'"):
        export_minari(tmp_path / "nonext", "toy/x-v0", data_format="zarr")
    make_dataset()
    import_minari("toy/reach-v0", tmp_path / "s").close()
    with pytest.raises(StoreExistsError):
        export_minari(tmp_path / "s", "toy/reach-v0")
    assert not (datasets_root / "toy" / "x-v0").exists()
    assert not [p for p in (datasets_root / "toy").iterdir() if "trajstore-partial" in p.name]


def test_cli_import_export_minari(tmp_path: Path, datasets_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dataset()
    assert main(["import", "minari", "toy/reach-v0", str(tmp_path / "s"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "minari" and out["episodes"] == 4 and out["steps"] == 50
    assert main(["export", "minari", str(tmp_path / "s"), "toy/cli-v0", "--datasets-path", str(tmp_path / "d"),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["destination"] == str(tmp_path / "d" / "toy" / "cli-v0")
    assert main(["info", str(tmp_path / "s")]) == 0
    assert "random-policy" in capsys.readouterr().out  # the dataset metadata, shown by trajstore info


def test_broken_dataset_leaves_no_partial_store(tmp_path: Path, datasets_root: Path) -> None:
    """A dataset whose last episode's group was deleted from main_data.hdf5 after writing: the
    import fails after writing the first episodes, and neither the store nor a temporary folder
    remains."""
    import h5py

    make_dataset()
    with h5py.File(datasets_root / "toy" / "reach-v0" / "data" / "main_data.hdf5", "r+") as f:
        assert "episode_3" in f
        del f["episode_3"]
    with pytest.raises(DamagedStoreError, match="episode 3 cannot be read .*episode_3"):
        import_minari("toy/reach-v0", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    assert not [p for p in tmp_path.iterdir() if "trajstore-partial" in p.name]


def test_broken_arrow_dataset_leaves_no_partial_store(tmp_path: Path, datasets_root: Path) -> None:
    """An arrow dataset whose last episode's file was cut short: the import fails after writing the
    first episodes with a DamagedStoreError naming the episode, and leaves nothing behind."""
    make_dataset(data_format="arrow")
    files = sorted((datasets_root / "toy" / "reach-v0" / "data" / "3").iterdir(), key=lambda f: f.suffix)
    assert [f.suffix for f in files] == [".arrow", ".json"]  # the episode's record batch, its metadata
    files[0].write_bytes(files[0].read_bytes()[:100])
    with pytest.raises(DamagedStoreError, match="episode 3 cannot be read"):
        import_minari("toy/reach-v0", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    assert not [p for p in tmp_path.iterdir() if "trajstore-partial" in p.name]


_EXPORT_PROGRAM = """
import sys, warnings
warnings.filterwarnings("ignore")
import trajstore.interop.minari as m
from trajstore.interop import export_minari
original = m._episodes
def slow(buf, ids, bar):  # one episode, then tell the parent and wait to be killed
    for k, ep in enumerate(original(buf, ids, bar)):
        yield ep
        if k == 0:
            open(sys.argv[3], "w").close()
            import time
            time.sleep(60)
m._episodes = slow
export_minari(sys.argv[1], "toy/killed-v0", datasets_path=sys.argv[2], data_format="arrow")
"""


def test_export_killed_midway_leaves_no_dataset(tmp_path: Path, datasets_root: Path) -> None:
    """SIGKILL of an arrow export after its first episode was written: no dataset of that id
    exists (minari does not find it, an import says so), the source store reopens intact, and the
    export run again writes the whole dataset."""
    import signal
    import subprocess
    import sys
    import time

    episodes = make_dataset(data_format="arrow")
    import_minari("toy/reach-v0", tmp_path / "s").close()
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _EXPORT_PROGRAM, str(tmp_path / "s"), str(datasets_root),
                              str(ready)])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the export child never wrote its first episode"
        partial = [p for p in (datasets_root / "toy").iterdir() if "trajstore-partial" in p.name]
        assert len(partial) == 1 and (partial[0] / "data" / "0").is_dir()  # killed mid-way, episode 0 written
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert not (datasets_root / "toy" / "killed-v0").exists()
    with pytest.raises(StoreNotFoundError, match="toy/killed-v0"):
        import_minari("toy/killed-v0", tmp_path / "never")
    assert verify_store(tmp_path / "s").ok
    export_minari(tmp_path / "s", "toy/killed-v0", data_format="arrow")
    # the killed export's temporary folder was removed by the new one (its process is gone)
    assert not [p for p in (datasets_root / "toy").iterdir() if "trajstore-partial" in p.name]
    again = minari.load_dataset("toy/killed-v0")
    assert [len(e.rewards) for e in again.iterate_episodes()] == [len(e["rewards"]) for e in episodes]


@pytest.mark.parametrize("data_format", ["hdf5", "arrow"])
def test_export_image_observations_exactly(tmp_path: Path, data_format: str) -> None:
    """Image observations (uint8 Box 0..255, 32x32x3: what minari JPEG-encodes by default) are
    exported exactly, not as lossy JPEG, in both formats."""
    from trajstore.recording import EPISODE_SPACE, step_space

    img = gym.spaces.Box(0, 255, (32, 32, 3), np.uint8)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (11, 32, 32, 3), dtype=np.uint8)  # noise: JPEG would change it
    with TrajectoryReplayBuffer.create(step_space(img, gym.spaces.Discrete(3), next_obs=True),
                                       episode_data_instance_space=EPISODE_SPACE, cache_path=tmp_path / "img") as b:
        b.extend({"obs": frames[:10], "next_obs": frames[1:], "action": rng.integers(0, 3, 10),
                  "reward": np.ones(10), "terminated": np.arange(10) == 9, "truncated": np.zeros(10, bool)})
    export_minari(tmp_path / "img", "toy/img-v0", data_format=data_format)
    ds = minari.load_dataset("toy/img-v0")
    assert ds.storage.FORMAT == data_format
    (ep,) = list(ds.iterate_episodes())
    np.testing.assert_array_equal(ep.observations, frames)


def _jpeg_dataset(dataset_id: str, data_format: str, lengths: tuple[int, ...] = (5, 9)) -> list[np.ndarray]:
    """A dataset whose Dict observations hold an image (minari JPEG-encodes it, its default) and a
    vector; returns each episode's T+1 images."""
    y, x = np.mgrid[0:48, 0:40]
    obs_space = gym.spaces.Dict({"cam": gym.spaces.Box(0, 255, (48, 40, 3), np.uint8),
                                 "pos": gym.spaces.Box(-1, 1, (2,), np.float32)})
    images, buffers = [], []
    for k, t in enumerate(lengths):
        cam = np.stack([np.stack([(128 + 100 * np.sin((x + 3 * i + c) / 6) * np.cos(y / 9)).astype(np.uint8)
                                  for c in range(3)], -1) for i in range(t + 1)])
        images.append(cam)
        buffers.append(EpisodeBuffer(id=k, seed=k, observations={"cam": cam, "pos": np.zeros((t + 1, 2), np.float32)},
                                     actions=np.zeros(t, np.int64), rewards=np.ones(t),
                                     terminations=np.arange(t) == t - 1, truncations=np.zeros(t, bool)))
    minari.create_dataset_from_buffers(dataset_id, buffers, observation_space=obs_space,
                                       action_space=gym.spaces.Discrete(2), algorithm_name="x", data_format=data_format)
    return images


def _stored_jpegs(ds_path: Path, data_format: str, ep: int) -> list[bytes]:
    """The JPEG bytes minari stored for episode ``ep``'s ``cam`` observations."""
    if data_format == "hdf5":
        import h5py

        with h5py.File(ds_path / "data" / "main_data.hdf5", "r") as f:
            return [np.asarray(a, np.uint8).tobytes() for a in f[f"episode_{ep}/observations/cam"][()]]
    import pyarrow.dataset as pads

    col = pads.dataset(str(ds_path / "data" / str(ep)), format=data_format,
                       ignore_prefixes=["_", ".", "metadata.json"]).to_table()["observations"]
    return [v.as_py() for v in col.combine_chunks().field("cam")]


@pytest.mark.parametrize("data_format", ["hdf5", "arrow"])
def test_import_keeps_minari_jpeg_frames_as_their_bytes(tmp_path: Path, datasets_root: Path, data_format: str) -> None:
    """With the destination a JPEG field at minari's quality (``MINARI_JPEG``), each stored frame is
    the JPEG minari stored, byte for byte (no decode/encode round trip); another codec transcodes."""
    pytest.importorskip("imagecodecs")
    from trajstore.interop._minari_frames import MINARI_JPEG
    from trajstore.storage.fields.image import read_index

    images = _jpeg_dataset("toy/cam-v0", data_format)
    comp = {"obs/cam": MINARI_JPEG, "next_obs/cam": MINARI_JPEG}
    with import_minari("toy/cam-v0", tmp_path / "jpeg", compressor=comp) as b:
        n = len(b)
    assert n == 14
    src = [_stored_jpegs(datasets_root / "toy" / "cam-v0", data_format, ep) for ep in range(2)]
    for side, pick in (("obs", lambda s: s[:-1]), ("next_obs", lambda s: s[1:])):
        arr = tmp_path / "jpeg" / "step_data" / side / "cam"
        C = json.loads((arr / "zarr.json").read_text())["chunk_grid"]["configuration"]["chunk_shape"][0]
        buf = np.fromfile(arr / "c" / "0" / "0" / "0" / "0", np.uint8)
        offsets, sizes = read_index(buf, C)
        stored = [buf[o : o + s].tobytes() for o, s in zip(offsets[:n].tolist(), sizes[:n].tolist())]
        assert stored == pick(src[0]) + pick(src[1]), side
    with TrajectoryReplayBuffer.load_from(tmp_path / "jpeg", read_only=True) as b:
        cam = b[:]["step_data"]["obs"]["cam"]
        assert 30 < 10 * np.log10(255**2 / np.mean((cam[:5].astype(float) - images[0][:5]) ** 2))
    # Another codec: transcoded from the decoded frames, losslessly here.
    with import_minari("toy/cam-v0", tmp_path / "png", compressor={"obs/cam": "png", "next_obs/cam": "png"}) as b:
        assert np.array_equal(b[:]["step_data"]["obs"]["cam"], cam)


def test_env_id_is_every_episodes_task_and_stats_at_import(tmp_path: Path) -> None:
    obs, act = gym.spaces.Box(-5, 5, (3,), np.float32), gym.spaces.Box(-2, 2, (1,), np.float32)
    rng = np.random.default_rng(0)
    bufs = [EpisodeBuffer(id=k, observations=rng.uniform(-1, 1, (5, 3)).astype(np.float32),
                          actions=rng.uniform(-1, 1, (4, 1)).astype(np.float32), rewards=np.full(4, float(k)),
                          terminations=np.arange(4) == 3, truncations=np.zeros(4, bool), infos={}) for k in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        minari.create_dataset_from_buffers("toy/pend-v0", bufs, env=gym.spec("Pendulum-v1"), observation_space=obs,
                                           action_space=act, algorithm_name="random-policy")
    with import_minari("toy/pend-v0", tmp_path / "s", stats=True) as buf:
        assert buf.tasks == ["Pendulum-v1"] and buf.episode_tasks() == {0: "Pendulum-v1", 1: "Pendulum-v1", 2: "Pendulum-v1"}
        s = buf.stats(episodes=[1, 2], fields=["reward"])["reward"]
        assert s["count"] == 8 and s["mean"] == 1.5
