"""to_dask on S3 (moto on 127.0.0.1): secrets in storage_options never enter the pickled task graph;
worker processes take credentials from their own environment."""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
import pytest
from test_remote import s3_options  # noqa: F401  (the moto S3 server fixture)

da = pytest.importorskip("dask.array", reason="needs dask")
cloudpickle = pytest.importorskip("cloudpickle")

from trajstore import ReplayBuffer  # noqa: E402
from trajstore.dask import to_dask  # noqa: E402
from trajstore.shards import create_shard, open_sharded  # noqa: E402
from trajstore.storage.credentials import OptionsRef, resolve, scrub  # noqa: E402

SPACE = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                         "reward": gym.spaces.Box(-np.inf, np.inf, (), np.float64)})
# Distinctive values: moto accepts any credentials, so these stand for a user's real secrets.
KEY, SECRET, SESSION = "AKIATRAJSTOREDASK0001", "dask-graph-secret-7f3a9c", "session-token-b81e"


@pytest.fixture
def secret_options(s3_options, monkeypatch):  # noqa: F811
    """The moto endpoint with secrets in storage_options, and other credentials in the environment
    (which spawned dask workers inherit)."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():
        monkeypatch.setenv(k, v)
    opts = {k: v for k, v in s3_options.items() if k not in ("key", "secret")}
    return {**opts, "key": KEY, "secret": SECRET, "client_kwargs": {**opts["client_kwargs"], "aws_session_token": SESSION}}


def _graph_bytes(arr) -> bytes:
    return cloudpickle.dumps(dict(arr.__dask_graph__()))


def _assert_no_secret(blob: bytes) -> None:
    for s in (KEY, SECRET, SESSION):
        assert s.encode() not in blob, f"{s} is in the pickled task graph"


def test_scrub_keeps_settings_and_resolves_only_here():
    opts = {"endpoint_url": "http://h", "anon": False, "key": KEY,
            "client_kwargs": {"region_name": "eu-west-1", "aws_secret_access_key": SECRET}}
    recipe = ("cls", "s3://b/x", opts)
    out = scrub(recipe)
    ref = out[2]
    assert isinstance(ref, OptionsRef) and out[:2] == recipe[:2]
    assert ref.settings == {"endpoint_url": "http://h", "anon": False, "client_kwargs": {"region_name": "eu-west-1"}}
    _assert_no_secret(cloudpickle.dumps(out) + repr(out).encode())
    assert scrub(recipe)[2].token == ref.token  # the same options: one reference (dask keys stay stable)
    assert resolve(out) == recipe  # this process made the reference: the full options
    foreign = OptionsRef("0" * 32, ref.settings)  # another process's reference: the settings alone
    assert resolve(("cls", foreign)) == ("cls", ref.settings)
    assert scrub(("p", {"anon": True})) == ("p", {"anon": True})  # nothing secret: unchanged


def test_to_dask_graph_holds_no_secret_and_workers_use_their_environment(secret_options):
    url = "s3://trajstore-test/dask-credentials"
    rng = np.random.default_rng(3)
    obs, reward = rng.standard_normal((700, 3)).astype(np.float32), rng.standard_normal(700)
    with ReplayBuffer.create(SPACE, cache_path=url, storage_options=secret_options, chunk_rows=256) as rb:
        rb.extend({"obs": obs, "reward": reward})
    ro = ReplayBuffer.load_from(url, read_only=True, storage_options=secret_options)
    arr = to_dask(ro.get_column("obs"))
    whole = to_dask(ro)
    _assert_no_secret(_graph_bytes(arr) + _graph_bytes(whole["reward"]))
    # threads: this process resolves the reference to the options it was given
    np.testing.assert_array_equal(arr.compute(scheduler="threads"), obs)
    # spawned processes: the settings from the graph, credentials from their inherited environment
    total = whole["reward"].sum().compute(scheduler="processes", num_workers=2)
    assert total == pytest.approx(reward.sum())
    ro.close()


def test_sharded_to_dask_graph_holds_no_secret(secret_options):
    root = "s3://trajstore-test/dask-sharded"
    for i, name in enumerate(("a", "b")):
        with create_shard(root, SPACE, shard=name, kind="replay", storage_options=secret_options) as w:
            w.extend({"obs": np.full((50, 3), i, np.float32), "reward": np.full(50, float(i))})
    ds = open_sharded(root, storage_options=secret_options)
    arr = to_dask(ds.get_column("reward"))
    _assert_no_secret(_graph_bytes(arr))
    assert float(arr.sum().compute(scheduler="threads")) == 50.0
    ds.close()
