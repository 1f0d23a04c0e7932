"""Dataset descriptions (trajstore.metadata): JSON only, set at create or later, kept by copies."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

from trajstore import ReplayBuffer, TrajectoryReplayBuffer
from trajstore.cli.maintain import copy_store
from trajstore.errors import ReadOnlyError
from trajstore.maintenance.verify import verify_store
from trajstore.metadata import DATASET_KEY, env_description, get_dataset_info, library_versions, set_dataset_info

SPACE = gym.spaces.Dict({"obs": gym.spaces.Box(-1, 1, (3,), np.float32)})


def test_set_get_merge_and_validate(tmp_path):
    path = str(tmp_path / "s")
    buf = TrajectoryReplayBuffer.create(SPACE, cache_path=path)
    assert get_dataset_info(buf) == {}
    set_dataset_info(buf, name="demo", author="me", algorithm="random",
                     **env_description(gym.make("CartPole-v1")))  # right after create
    buf.extend({"obs": np.zeros((10, 3), np.float32)})
    buf.close()
    info = set_dataset_info(path, license="MIT", code_permalink="https://example.org/x@abc", author=None)  # later
    assert "author" not in info and info["license"] == "MIT" and info["name"] == "demo"
    assert info["env_id"] == "CartPole-v1" and info["env_spec"]["max_episode_steps"] == 500
    assert get_dataset_info(path) == info
    assert set(library_versions()) >= {"numpy", "zarr", "gymnasium"}
    raw = json.loads((tmp_path / "s" / DATASET_KEY).read_text())  # plain JSON next to the data
    assert raw == info
    with pytest.raises(TypeError, match="not JSON"):
        set_dataset_info(path, thing=object())
    with pytest.raises(ValueError, match="not valid JSON"):
        set_dataset_info(path, score=float("nan"))
    with pytest.raises(TypeError, match="keys must be strings"):
        set_dataset_info(path, table={1: "a"})
    assert set_dataset_info(path, replace=True, name="new") == {"name": "new"}
    with TrajectoryReplayBuffer.load_from(path, read_only=True) as ro:
        assert get_dataset_info(ro) == {"name": "new"}
        with pytest.raises(ReadOnlyError):
            set_dataset_info(ro, name="x")
    assert verify_store(path).ok  # the extra key does not upset verify


def test_copies_keep_description(tmp_path):
    src = str(tmp_path / "src")
    with ReplayBuffer.create(SPACE, cache_path=src) as rb:
        rb.extend({"obs": np.ones((5, 3), np.float32)})
        set_dataset_info(rb, name="kept", tags=["a", "b"], nested={"x": 1.5})
        rb.dumps(str(tmp_path / "dumped"))
        rb.dumps(str(tmp_path / "dumped.zip"))
    want = {"name": "kept", "tags": ["a", "b"], "nested": {"x": 1.5}}
    assert get_dataset_info(str(tmp_path / "dumped")) == want
    assert get_dataset_info(str(tmp_path / "dumped.zip")) == want
    copy_store(src, str(tmp_path / "cli_copy"))  # `trajstore copy` (byte copy)
    assert get_dataset_info(str(tmp_path / "cli_copy")) == want


def test_info_shows_and_relayout_copy_keeps_the_description(tmp_path, capsys):
    """`trajstore info` prints the dataset description (and --json carries it); a copy that
    changes the layout keeps it, like dumps and plain copies do."""
    from trajstore.cli import main

    with ReplayBuffer.create(gym.spaces.Box(-1, 1, (3,), np.float32), cache_path=tmp_path / "s") as rb:
        rb.extend(np.zeros((10, 3), np.float32))
    set_dataset_info(tmp_path / "s", name="unit-test set", author="trajstore", env_id="CartPole-v1")
    assert main(["info", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "dataset" in out and "unit-test set" in out
    assert main(["info", str(tmp_path / "s"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dataset"]["name"] == "unit-test set"
    assert main(["copy", str(tmp_path / "s"), str(tmp_path / "c"), "--compressor", "lz4"]) == 0
    capsys.readouterr()
    assert get_dataset_info(tmp_path / "c")["author"] == "trajstore"
