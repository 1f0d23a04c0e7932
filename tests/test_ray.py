"""trajstore.ray (issue 17): Ray actors each record a gymnasium env into a shard of their own while a
learner (this process) samples the growing sharded dataset and trains a torch model from it.

A real local Ray cluster (127.0.0.1, num_cpus=2, no dashboard, no usage report) is started once for
the module and shut down by the fixture's finalizer, also when a test fails.  Actors report what
they committed (shard, rows, episode ids and lengths); the learner checks every committed step is
readable, episodes whole: lengths, ids, ``obs[t+1] == next_obs[t]`` inside an episode, done flags
only on an episode's last step, episode data matching.  One actor is SIGKILLed mid-collect: its
committed steps survive and its shard reopens as a writer.
"""

from __future__ import annotations

import copy
import functools
import os
import signal
import time

import gymnasium
import numpy as np
import pytest
from test_remote import s3_options  # noqa: F401  (the moto S3 server fixture)

from trajstore import TrajectoryReplayBuffer
from trajstore.errors import BadOptionError
from trajstore.recording import RecordEpisodes
from trajstore.shards import open_sharded

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
import trajstore.ray as tray  # noqa: E402  (after the importorskip: it imports ray)

pytestmark = pytest.mark.slow  # a Ray cluster start alone takes 10-20 s here

CARTPOLE = functools.partial(gymnasium.make, "CartPole-v1")
#: Dummy credentials the actors find in their environment (inherited from this process, which
#: starts the cluster): what a real cluster gets from a profile or an instance role.
_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    try:
        ray.init(num_cpus=2, include_dashboard=False, address="local", _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_committed(root, acks, storage_options=None):
    """Every step each actor acknowledged is readable from the dataset at ``root``, episodes whole
    (see the module docstring).  ``acks``: its actors' stats; an episode an actor was still running
    when it reported may have grown since."""
    ds = open_sharded(root, storage_options=storage_options)
    eps = ds.episodes()
    starts = dict(zip(ds.shards["shard"].tolist(), ds.shards["start"].tolist()))
    for ack in acks:
        mine = eps["shard"] == ack["shard"]
        ids, lengths, live = eps["shard_episode_id"][mine], eps["length"][mine], eps["live"][mine]
        n = len(ack["episode_ids"])
        assert n and ids[:n].tolist() == ack["episode_ids"].tolist()
        assert lengths[:n - 1].tolist() == ack["lengths"][:-1].tolist() and lengths[n - 1] >= ack["lengths"][-1]
        rows = np.arange(starts[ack["shard"]], starts[ack["shard"]] + int(lengths.sum()))
        data = ds.get_at(rows)
        step, ep_ids = data["step_data"], ds.row_source().step_ids(rows)
        assert (np.repeat(eps["episode_id"][mine], lengths) == ep_ids).all()
        ends = np.cumsum(lengths) - 1  # each episode's last row
        inside = np.ones(len(rows) - 1, bool)
        inside[ends[:-1]] = False  # rows t and t+1 of one episode
        np.testing.assert_array_equal(step["obs"][1:][inside], step["next_obs"][:-1][inside])
        done = step["terminated"] | step["truncated"]
        assert not done[:-1][inside].any()  # a done flag only on an episode's last step
        assert done[ends[:-1]].all()  # every episode but the last ended on one
        finished = np.repeat(~live, lengths)
        np.testing.assert_array_equal(data["episode_data"]["length"][finished], np.repeat(lengths, lengths)[finished])
    ds.close()


class _Dynamics(torch.nn.Module):
    """A small MLP predicting the observation change of a CartPole transition."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def loss(self, batch) -> torch.Tensor:
        s = batch["step_data"]
        x = torch.cat([s["obs"], s["action"].float()[:, None]], dim=1)
        return torch.nn.functional.mse_loss(self.net(x), s["next_obs"] - s["obs"])


def test_actors_write_while_a_learner_trains(tmp_path, cluster):
    root = str(tmp_path / "ds")
    actors = tray.start_actors(root, CARTPOLE, 2, shards=["actor-0", "actor-1"], flush_every=50,
                               chunk_rows=256, commit_interval=3600)  # commits: the actors' flushes only
    try:
        ray.get([a.stats.remote() for a in actors])  # both shards exist
        ds = open_sharded(root, backend="torch")
        torch.manual_seed(0)
        model = _Dynamics()
        # The loss a trained model is judged against: the untrained one's on the same batch (a
        # loss taken after round one can already be at the noise floor: the number of steps taken
        # while the actors collect depends on the machine's speed).
        untrained = copy.deepcopy(model)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        rng = np.random.default_rng(0)
        seen, steps, fixed = set(), 0, None
        for _ in range(3):  # rounds: the learner trains while the actors collect
            seen.add(len(ds))  # the actors are idle between rounds: 0, 400, 800 rows
            refs = [a.collect.remote(200) for a in actors]
            while ray.wait(refs, num_returns=len(refs), timeout=0)[1]:
                if len(ds) < 64:
                    time.sleep(0.01)
                    continue
                loss = model.loss(ds.sample(64, rng=rng))
                opt.zero_grad()
                loss.backward()
                opt.step()
                steps += 1
            acks = ray.get(refs)
            ds.refresh()  # the actors are idle: the dataset is exactly what they committed
            assert ds.shards["rows"].tolist() == [a["rows"] for a in acks]
            _check_committed(root, acks)
            if fixed is None:
                fixed = ds.sample(512, rng=rng)
                with torch.no_grad():
                    first_loss = float(untrained.loss(fixed))
        for _ in range(100):  # a few more steps on the whole dataset
            loss = model.loss(ds.sample(64, rng=rng))
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            assert float(model.loss(fixed)) < first_loss / 10
        final = ray.get([a.close.remote() for a in actors])
        assert [f["rows"] for f in final] == [600, 600]
        ds.refresh()
        assert not ds.episodes()["live"].any() and len(ds) == 1200
        _check_committed(root, final)
        assert seen == {0, 400, 800}  # the learner read the dataset at every size between rounds
        ds.close()
    finally:
        for a in actors:
            ray.kill(a)


def test_sigkilled_actor_keeps_committed_steps(tmp_path, cluster):
    root = str(tmp_path / "ds")
    (actor,) = tray.start_actors(root, CARTPOLE, 1, shards=["victim"], flush_every=20, seed=3,
                                 commit_interval=3600)  # commits: the actor's flushes only
    try:
        ack = ray.get(actor.collect.remote(150))
        ds = open_sharded(root)
        running = actor.collect.remote(10**7)
        deadline = time.monotonic() + 60
        while len(ds) <= ack["rows"] + 100 and time.monotonic() < deadline:  # mid-way through the call
            time.sleep(0.01)
        os.kill(ack["pid"], signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(running, timeout=60)
    finally:
        ray.kill(actor)
    ds.close()
    ds = open_sharded(root)  # reopened after the kill
    assert len(ds) > ack["rows"] + 100
    _check_committed(root, [ack])
    killed_rows = len(ds)
    shard = os.path.join(root, "shards", "victim")
    env = RecordEpisodes(CARTPOLE(), TrajectoryReplayBuffer.load_from(shard), record_next_obs=True)
    env.reset(seed=0)
    for _ in range(5):
        env.step(env.action_space.sample())
    env.close()
    env.buffer.close()
    ds.refresh()
    assert len(ds) == killed_rows + 5
    ds.close()


def test_bad_input_refused_before_any_actor_starts(tmp_path):
    """A secret in storage_options, bad shard names or counts are refused before any actor starts or
    anything is written (no Ray cluster needed: the checks run first)."""
    root = tmp_path / "ds"
    for opts in ({"key": "AKIA", "endpoint_url": "http://127.0.0.1:1"}, {"secret": "s"}, {"token": "t"},
                 {"client_kwargs": {"aws_secret_access_key": "s"}}, {"password": "p"}, "profile=lab"):
        with pytest.raises(BadOptionError):
            tray.start_actors(str(root), CARTPOLE, 1, storage_options=opts)
    assert not root.exists()
    tray.check_storage_options({"profile": "lab", "endpoint_url": "http://x", "anon": False,
                                "client_kwargs": {"region_name": "us-east-1"}})
    for kwargs in ({"shards": ["a", "a"]}, {"shards": ["a"]}, {"shards": ["../up", "b"]}, {"num_actors": 0}):
        with pytest.raises(BadOptionError):
            tray.start_actors(str(root), CARTPOLE, **{"num_actors": 2, **kwargs})
    with pytest.raises(BadOptionError):
        tray.ShardWriter(str(root), CARTPOLE, flush_every=0)
    assert not root.exists()


def test_actors_write_s3_with_credentials_from_their_environment(s3_options, cluster):  # noqa: F811
    """Actors writing to S3 (moto) get no credentials in their arguments: only the endpoint travels;
    the keys come from the environment the actor processes inherited."""
    settings = {k: v for k, v in s3_options.items() if k not in ("key", "secret")}
    root = "s3://trajstore-test/ray-ds"
    # resolved in each actor (a callable: it could read a secret store there; this one holds none)
    out = tray.run_actors(root, CARTPOLE, num_actors=2, steps=60, flush_every=25,
                          storage_options=functools.partial(dict, settings))
    assert sorted(o["rows"] for o in out) == [60, 60]
    _check_committed(root, out, s3_options)
    ds = open_sharded(root, storage_options=settings)  # the learner's keys come from its environment too
    assert len(ds) == 120 and not ds.episodes()["live"].any()
    ds.close()
